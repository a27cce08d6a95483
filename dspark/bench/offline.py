"""The offline suite: methods x datasets x temperature x block size x concurrency, interleaved.

Every (method, block size) variant runs the same prompt group back to back, in an order that rotates
from group to group and repeat to repeat, so drift on a shared machine hits every method alike.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from dspark.bench.acceptance import AcceptanceCounter
from dspark.bench.datasets import Dataset
from dspark.bench.methods import DRAFTING, ENGINE_METHODS, BatchRun, Setup, build_method, shared_target
from dspark.bench.stats import latency_summary, spread
from dspark.sampling_params import SamplingParams


@dataclass(frozen=True)
class OfflineConfig:
    """What the suite sweeps and how long it runs."""

    methods: list[str]
    max_tokens: int = 256
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    block_sizes: list[int | None] = field(default_factory=lambda: [None])  # None: each method's default
    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 1
    seed: int = 0
    raw: bool = False  # prompts as is, without the chat template
    ignore_eos: bool = False
    progress: bool = True


@dataclass(frozen=True)
class Variant:
    """One method at one block size."""

    method: str
    block_size: int | None

    @property
    def label(self) -> str:
        return self.method if self.block_size is None else f"{self.method}@{self.block_size}"


def variants(cfg: OfflineConfig) -> list[Variant]:
    """Drafting methods once per block size; the others once."""
    out = []
    for m in cfg.methods:
        blocks = cfg.block_sizes if m in DRAFTING else [None]
        out += [Variant(m, b) for b in blocks]
    return out


def encode_prompts(tokenizer, prompts: list[str], raw: bool) -> list[list[int]]:
    """Token ids of each first turn, through the chat template unless raw (or the model has none)."""
    if not raw and tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]


def kv_cache_mb(setup: Setup, longest: int, max_tokens: int, concurrency: int) -> int:
    """A KV pool big enough for `concurrency` of the longest request (plus draft room), in MiB."""
    from dspark.models.embedded import resolve_model_path
    from dspark.models.config import ModelConfig
    from dspark.cache import KVCache
    from dspark.models.decoder import kv_cache_dtype
    from dspark.models.loader import resolve_dtype

    c = ModelConfig.from_pretrained(resolve_model_path(setup.model))
    kv_dtype = kv_cache_dtype(resolve_dtype(setup.dtype, setup.device), setup.device)
    per_token = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
    tokens = concurrency * (longest + max_tokens + 80)
    return max(8, int(tokens * per_token * 1.25) // 2**20 + 1)


def _params(cfg: OfflineConfig, temperature: float, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos,
                           seed=None if temperature == 0 else cfg.seed + i) for i in range(n)]


def _groups(n: int, concurrency: int) -> list[range]:
    size = 1 if concurrency == 1 else 2 * concurrency  # a closed loop needs requests to refill it
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def run_offline(datasets: list[Dataset], cfg: OfflineConfig, setup: Setup) -> dict:
    """Run the suite; return the 'offline' section of results.json."""
    from transformers import AutoTokenizer

    from dspark.models.embedded import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(setup.model)))
    encoded = {d.name: encode_prompts(tokenizer, d.prompts, cfg.raw) for d in datasets}
    longest = max(len(p) for ps in encoded.values() for p in ps)
    setup = Setup(**{**asdict(setup), "max_num_seqs": max(cfg.concurrency),
                     "kv_cache_mb": kv_cache_mb(setup, longest, cfg.max_tokens, max(cfg.concurrency))})
    methods, skipped = {}, []
    with shared_target():
        for v in tqdm(variants(cfg), desc="loading methods", disable=not cfg.progress, file=sys.stderr):
            try:
                methods[v] = build_method(v.method, setup, v.block_size)
            except Exception as e:  # one broken or unavailable method must not sink the whole suite
                reason = str(e) if isinstance(e, (FileNotFoundError, ModuleNotFoundError, ValueError)) \
                    else f"{type(e).__name__}: {e}"
                skipped.append({"method": v.label, "reason": reason})
                print(f"dspark bench: skipping {v.label}: {reason}", file=sys.stderr)
    warm = next(iter(encoded.values()))[0]
    for m in methods.values():  # first-call costs (allocations, lazy init) stay out of the timing
        m.run([warm], [SamplingParams(max_tokens=8)])

    runs: dict[tuple, list[BatchRun]] = {}  # (variant, dataset, T, conc, repeat) -> batch runs, in order
    jobs = [(t, c, d) for t in cfg.temperatures for c in cfg.concurrency for d in datasets]
    total = sum(len(_groups(len(d.prompts), c)) for t, c, d in jobs) * len(methods) * cfg.repeats
    bar = tqdm(total=total, desc="offline", disable=not cfg.progress, file=sys.stderr)
    order = list(methods)
    for t, c, d in jobs:
        params = _params(cfg, t, len(d.prompts))
        for rep in range(cfg.repeats):
            for g, idx in enumerate(_groups(len(d.prompts), c)):
                shift = (g + rep) % len(order)
                for v in order[shift:] + order[:shift]:
                    if c > 1 and v.method not in ENGINE_METHODS:
                        bar.update()
                        continue
                    bar.set_postfix_str(f"{d.name} T={t} c={c} {v.label}")
                    run = methods[v].run([encoded[d.name][i] for i in idx], [params[i] for i in idx], c)
                    runs.setdefault((v, d.name, t, c, rep), []).append(run)
                    bar.update()
    bar.close()
    for v in methods:
        if v.method not in ENGINE_METHODS and any(c > 1 for c in cfg.concurrency):
            skipped.append({"method": v.label, "reason": "outside references run at concurrency 1 only"})
    cells = [_cell(v, t, c, d, runs, cfg, getattr(methods[v], "draft_vocab", None))
             for t, c, d in jobs for v in methods if (v, d.name, t, c, 0) in runs]
    _compare_to_ar(cells)
    return {"config": {**asdict(cfg), "datasets": {d.name: {"source": d.source, "prompts": len(d.prompts)}
                                                   for d in datasets}},
            "setup": {k: v for k, v in asdict(setup).items() if k not in ("max_num_seqs", "kv_cache_mb")},
            "cells": cells, "skipped": skipped}


def _cell(v: Variant, t: float, c: int, d: Dataset, runs: dict, cfg: OfflineConfig, vocab=None) -> dict:
    reps = [runs[(v, d.name, t, c, r)] for r in range(cfg.repeats)]
    speeds = [sum(len(x.token_ids) for b in rep for x in b.completions) / sum(b.seconds for b in rep)
              for rep in reps]
    first = [x for b in reps[0] for x in b.completions]
    acc = AcceptanceCounter()
    for x in first:
        if x.windows is not None:
            acc.add(x.accept_lengths, x.windows, x.confidences)
        elif x.drafted:
            acc.add_drafts(x.drafted, x.accepted or 0)
    steps = sum(b.verify_steps or 0 for b in reps[0])  # rounds counted by a method without per-round data
    tau = acc.tau if acc.rounds else (1 + acc.drafts_kept / steps if steps else None)
    wall = sum(b.seconds for rep in reps for b in rep)
    split = {k: sum(b.split.get(k, 0.0) for rep in reps for b in rep) for k in ("draft", "plan", "verify")}
    split = {k: s / wall for k, s in split.items()} if v.method in ENGINE_METHODS else {}
    if split:
        split["other"] = max(0.0, 1.0 - sum(split.values()))
    every = [x for rep in reps for b in rep for x in b.completions]
    user = [len(x.token_ids) / (x.ttft + x.tpot * (len(x.token_ids) - 1)) for x in every
            if x.ttft is not None and x.tpot is not None and x.token_ids]
    return {
        "method": v.method, "label": v.label, "dataset": d.name, "temperature": t, "block_size": v.block_size,
        "concurrency": c, "prompts": len(first), "output_tokens": sum(len(x.token_ids) for x in first),
        "tokens_per_s": spread(speeds), "tau": tau,
        "draft_acceptance": acc.draft_acceptance,
        "accept_by_position": acc.conditional(), "rounds": acc.rounds, "time_split": split,
        "confidence_calibration": acc.calibration(),
        "ttft_s": latency_summary([x.ttft for x in every]), "tpot_s": latency_summary([x.tpot for x in every]),
        "per_user_tokens_per_s": latency_summary(user)["p50"],
        "outside_draft_vocab": _outside(first, vocab),
        "token_ids": [x.token_ids for x in first],
    }


def _outside(completions: list, vocab) -> float | None:
    """Share of output tokens the drafter could never propose (outside its draft vocabulary)."""
    ids = [t for x in completions for t in x.token_ids]
    if vocab is None or not ids:
        return None
    inside = set(vocab.tolist())
    return sum(t not in inside for t in ids) / len(ids)


def _compare_to_ar(cells: list[dict]) -> None:
    """Fill speedup and the token-for-token match against ar of the same dataset, T and concurrency."""
    ar = {(x["dataset"], x["temperature"], x["concurrency"]): x for x in cells if x["method"] == "ar"}
    for x in cells:
        base = ar.get((x["dataset"], x["temperature"], x["concurrency"]))
        x["speedup"] = None
        x["matches_ar"] = None
        x["mismatched_prompts"] = []
        if base is not None and base["tokens_per_s"]["median"]:
            x["speedup"] = x["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
            if x["temperature"] == 0:
                x["mismatched_prompts"] = [i for i, (a, b) in enumerate(zip(x["token_ids"], base["token_ids"]))
                                           if a != b]
                x["matches_ar"] = not x["mismatched_prompts"]
    for x in cells:
        del x["token_ids"]
