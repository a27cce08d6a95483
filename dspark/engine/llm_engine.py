"""LLMEngine: continuous batching with one loop for every method.

step(): schedule -> propose -> plan -> verify (one ragged forward) -> accept -> commit.
Plain decoding is the case of zero drafts.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from dspark.cache import KVCache
from dspark.config import EngineConfig
from dspark.engine.detokenizer import final_text
from dspark.engine.model_runner import ModelRunner, Window
from dspark.engine.scheduler import Scheduler
from dspark.engine.sequence import Sequence, Status
from dspark.engine.stop import commit_tokens
from dspark.models.decoder import Decoder
from dspark.outputs import RequestOutput
from dspark.sampling.keyed import accept_keyed, couple_drafts, sample_keyed
from dspark.sampling.rejection import Acceptance, accept_greedy, accept_sampled
from dspark.sampling.sampler import sample_logits, warp_candidates
from dspark.sampling_params import SamplingParams
from dspark.speculative.config import VerifyMode
from dspark.speculative.planners import FixedPlanner
from dspark.speculative.proposer import NoProposer, Proposal, Proposer

log = logging.getLogger("dspark.engine")


@dataclass
class EngineStats:
    """Global counters since start-up."""

    steps: int = 0
    rounds: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    committed: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    time_draft: float = 0.0
    time_plan: float = 0.0
    time_verify: float = 0.0
    skipped_drafting: int = 0  # steps whose decodes ran without drafting (the planner's call)


class LLMEngine:
    """Owns the model, cache, scheduler and proposer; callers add requests and call step()."""

    def __init__(self, model: Decoder, tokenizer, config: EngineConfig | None = None, *,
                 proposer: Proposer | None = None, planner=None):
        """config: the settings (default EngineConfig()); its target part says how `model` was loaded.
        proposer / planner: built from config.speculative (speculative/factory.py); none = plain decoding
        and, with drafts, verify every one."""
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        per_token = KVCache.bytes_per_token(model.config.num_layers, model.config.num_kv_heads,
                                            model.config.head_dim, model.kv_dtype)
        self.cache: KVCache = model.new_cache(config.cache.num_blocks(per_token), config.cache.kv_block_size)
        self.proposer: Proposer = proposer or NoProposer()
        self.planner = planner or FixedPlanner()
        self.verify_mode = config.speculative.verify_mode
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.runner = ModelRunner(model, self.cache, self.proposer.hidden_layers)
        self.max_model_len = min(config.target.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raise ValueError for an empty or over-long prompt."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the model's context is {self.max_model_len} "
                             "(prompt + at least one generated token must fit)")
        capacity = self.cache.num_blocks * self.cache.block_size
        if n + 1 + self.proposer.max_drafts > capacity:
            raise ValueError(f"prompt has {n} tokens; the KV cache holds {capacity}")
        request_id = request_id or str(next(self._ids))
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                       params=params)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its cache (no-op if unknown or finished)."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched forward; return outputs of the requests that changed.

        A request whose own processing raises is finished with finish_reason "error" (and its `error`);
        the step's other requests go on. If the batched part itself raises, each request is retried by
        itself, so only the one that fails alone is failed."""
        batch = self.scheduler.schedule(1 + self.proposer.max_drafts)
        for seq in batch.preempted:
            self.proposer.release(seq)
            self.stats.preemptions += 1
        if not batch.prefills and not batch.decodes:
            return []
        try:
            changed = self._run(batch.prefills, batch.decodes)
        except Exception as e:  # noqa: BLE001 - attributed below, request by request
            changed = self._run_alone(batch.prefills, batch.decodes, e)
        self.stats.steps += 1
        return [self._isolated_output(s) for s in changed]

    def _run(self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence]) -> list[Sequence]:
        """One step's phases: propose drafts, plan each request's window, verify every window (and the
        prefill chunks) in one ragged forward, then accept and commit request by request."""
        t0 = time.perf_counter()
        prefill_tokens = sum(n for _, n in prefills)  # they share this round's verify pass
        context = sum(s.num_cached for s in decodes)  # the decodes' cached tokens: the planner prices it
        proposal = self._couple(decodes, self._propose(decodes, prefill_tokens, context))
        t1 = time.perf_counter()
        lengths = self._plan(decodes, proposal, prefill_tokens, context)
        t2 = time.perf_counter()
        result = self.runner.run(self._windows(prefills, decodes, proposal, lengths))
        t3 = time.perf_counter()
        changed = []
        for i, (seq, n) in enumerate(prefills):
            changed += self._isolated(seq, self._after_prefill, seq, n, result.logits[i], result.hidden[i])
        k = len(prefills)
        for i, seq in enumerate(decodes):
            changed += self._isolated(seq, self._after_verify, seq, proposal, i, lengths[i], result.logits[k + i],
                                      result.hidden[k + i])
        st = self.stats
        st.time_draft += t1 - t0
        st.time_plan += t2 - t1
        st.time_verify += t3 - t2
        return changed

    def _windows(self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence], proposal: Proposal,
                 lengths: list[int]) -> list[Window]:
        """The forward's rows: each prefill chunk (logits only where its prompt ends), then each decode's
        last token + its planned drafts (all of them in cap-accept mode), logits on every row."""
        windows = [Window(s.request_id, s.tokens[s.num_cached : s.num_cached + n], s.num_cached,
                          "last" if not s.output_token_ids and s.num_cached + n == s.prefill_target else "none")
                   for s, n in prefills]
        full = self.verify_mode == VerifyMode.CAP_ACCEPT
        return windows + [Window(s.request_id, [s.last_token] + proposal.tokens[i][: None if full else lengths[i]],
                                 s.num_cached, "all") for i, s in enumerate(decodes)]

    def _run_alone(self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence],
                   error: Exception) -> list[Sequence]:
        """The batched forward raised: run each request by itself and fail only those that raise again.

        Nothing a failed forward did is committed (the K/V it wrote lie past num_cached and are written
        again), so a retried request continues as if the failed forward had not happened."""
        jobs = [([job], []) for job in prefills] + [([], [seq]) for seq in decodes]
        if len(jobs) == 1:
            seq = prefills[0][0] if prefills else decodes[0]
            self._fail(seq, error)
            return [seq]
        changed = []
        for alone_prefills, alone_decodes in jobs:
            seq = alone_prefills[0][0] if alone_prefills else alone_decodes[0]
            try:
                changed += self._run(alone_prefills, alone_decodes)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                self._fail(seq, e)
                changed.append(seq)
        return changed

    def _isolated(self, seq: Sequence, fn, *args) -> list[Sequence]:
        """fn(*args), one request's share of the step; if it raises, that request alone fails."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the other requests of the step must go on
            self._fail(seq, e)
            return [seq]

    def _isolated_output(self, seq: Sequence) -> RequestOutput:
        try:
            return self._output(seq)
        except Exception as e:  # noqa: BLE001 - e.g. the final detokenization of this request
            self._fail(seq, e)
            return self._output(seq)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """Finish a request whose processing raised, with finish_reason "error"; its cache is freed."""
        log.error("request %s failed in the engine step; it is stopped, the others go on", seq.request_id,
                  exc_info=error)
        seq.error = f"{type(error).__name__}: {error}"
        seq.finish_reason = "error"
        if not seq.finished:
            self._finish(seq)

    def _propose(self, seqs: list[Sequence], prefill_tokens: int, context: int) -> Proposal:
        """Drafts for the decoding requests, unless the planner says drafting cannot pay this round."""
        if not seqs or self.proposer.max_drafts == 0:
            return self.proposer.propose(seqs)
        ids = [s.request_id for s in seqs]
        if self.verify_mode == VerifyMode.STATIC:
            return self.proposer.propose(seqs)
        if not self.planner.should_draft(ids, prefill_tokens, context):
            self.stats.skipped_drafting += 1
            return Proposal(tokens=[[] for _ in seqs], probs=[None] * len(seqs), confidences=None)
        return self.proposer.propose(seqs, self.planner.num_drafts(ids, self.proposer.max_drafts, prefill_tokens,
                                                                   context))

    def _couple(self, seqs: list[Sequence], proposal: Proposal) -> Proposal:
        """Seeded sampled requests draft with the noise their verification will use (sampling/keyed.py),
        so their drafts are accepted about as often as with rejection sampling."""
        tokens = list(proposal.tokens)
        for i, seq in enumerate(seqs):
            q = proposal.probs[i] if proposal.probs else None
            if _keyed(seq.params) and q is not None and tokens[i]:
                tokens[i] = couple_drafts(q[: len(tokens[i])], seq.params.seed, len(seq.output_token_ids))
        return dataclasses.replace(proposal, tokens=tokens)

    def _plan(self, seqs: list[Sequence], proposal: Proposal, prefill_tokens: int, context: int) -> list[int]:
        n = [len(t) for t in proposal.tokens]
        if not seqs or self.verify_mode == VerifyMode.STATIC or not any(n):
            return n
        lengths = self.planner.plan([s.request_id for s in seqs], proposal.confidences or [[1.0] * k for k in n],
                                    prefill_tokens, context)
        return [min(a, b) for a, b in zip(lengths, n)]

    def _after_prefill(self, seq: Sequence, n: int, logits, hidden) -> list[Sequence]:
        start = seq.num_cached
        seq.num_cached += n
        self.stats.prefill_tokens += n
        self.proposer.observe(seq, hidden, start)
        if logits is None:
            return []
        token = self._sample(seq, logits)[0]  # first generated token
        seq.first_token_time = time.perf_counter()
        self._commit(seq, [token])
        return [seq]

    def _after_verify(self, seq: Sequence, proposal: Proposal, i: int, l: int, logits, hidden) -> list[Sequence]:
        drafts = proposal.tokens[i][:l]
        acc = self._accept(seq, drafts, proposal.probs[i], logits[: l + 1])
        start = seq.num_cached
        committed = self._commit(seq, acc.tokens)
        # the cache keeps the anchor and the accepted drafts; the rejected tail is dropped
        seq.num_cached = start + min(committed, acc.num_accepted + 1)
        if not seq.finished:
            self.cache.truncate(seq.request_id, seq.num_cached)
            self.proposer.observe(seq, None if hidden is None else hidden[: seq.num_cached - start], start)
        st, ss = self.stats, seq.stats
        for counters in (st, ss):  # global and per-request speculation counters
            counters.rounds += 1
            counters.drafted += len(proposal.tokens[i])
            counters.verified += l
            counters.accepted += acc.num_accepted
        self.planner.observe(seq.request_id, l, acc.num_accepted)
        ss.accept_lengths.append(committed)
        ss.verify_lengths.append(l)
        ss.confidences.append(proposal.confidences[i][: len(proposal.tokens[i])] if proposal.confidences else [])
        return [seq]

    def _accept(self, seq: Sequence, drafts: list[int], draft_probs, logits: torch.Tensor) -> Acceptance:
        p = seq.params
        if p.greedy:
            return accept_greedy(drafts, logits)
        target, ids = warp_candidates(logits, p.temperature, p.top_k, p.top_p)
        if _keyed(p):  # the next token is at output position len(output_token_ids)
            return accept_keyed(drafts, target, p.seed, len(seq.output_token_ids), ids)
        if ids is not None:  # the top-k candidates' probabilities in full rows (everything else is 0)
            target = torch.zeros(logits.shape, dtype=target.dtype, device=target.device).scatter_(-1, ids, target)
        if draft_probs is None:  # a deterministic proposer: the draft distribution is a point mass
            draft_probs = torch.zeros(len(drafts), target.shape[1])
            draft_probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
        return accept_sampled(drafts, draft_probs[: len(drafts)], target, seq.generator)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        p = seq.params
        if p.greedy:
            return logits.argmax(-1).tolist()
        if _keyed(p):
            probs, ids = warp_candidates(logits, p.temperature, p.top_k, p.top_p)
            return sample_keyed(probs, p.seed, len(seq.output_token_ids), ids)
        return sample_logits(logits, p.temperature, p.top_k, p.top_p, seq.generator).tolist()

    def _commit(self, seq: Sequence, tokens: list[int]) -> int:
        n = commit_tokens(seq, tokens, eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                          tokenizer=self.tokenizer)
        self.stats.committed += n
        if seq.finish_reason is not None:
            self._finish(seq)
        return n

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.proposer.release(seq)
        self.planner.release(seq.request_id)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = final_text(seq, self.tokenizer) if seq.finished and seq.error is None else seq.text
        if seq.finished:
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids, text=text,
            token_ids=list(seq.output_token_ids), finished=seq.finished, finish_reason=seq.finish_reason,
            error=seq.error,
            accept_lengths=list(seq.stats.accept_lengths), verify_lengths=list(seq.stats.verify_lengths),
            draft_confidences=list(seq.stats.confidences),
            metrics={"rounds": seq.stats.rounds, "drafted": seq.stats.drafted, "verified": seq.stats.verified,
                     "accepted": seq.stats.accepted, "arrival": seq.arrival,
                     "first_token_time": seq.first_token_time, "finish_time": seq.finish_time},
        )


def _keyed(params: SamplingParams) -> bool:
    """Seeded sampling draws per (seed, output position), so drafts and batch cannot change the text."""
    return params.seed is not None and not params.greedy
