"""The methods a benchmark compares, behind one small interface.

Engine methods (ar, ngram, dflash, dspark-<planner>) run through dspark's one decoding loop and share
one copy of the target weights. Outside references: transformers' generate() (plain and prompt lookup)
and llama.cpp through llama-cpp-python when it is installed (same GGUF as the embedded target).
"""
from __future__ import annotations

import contextlib
import importlib.util
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dspark.bench.llama_server import LLAMA_SERVER_METHODS
from dspark.sampling_params import SamplingParams

ENGINE_METHODS = {  # name -> EngineConfig keywords
    "ar": dict(speculative_algorithm="NONE"),
    "ngram": dict(speculative_algorithm="NGRAM"),
    "dflash": dict(speculative_algorithm="DFLASH"),
    "dspark-fixed": dict(speculative_algorithm="DSPARK", planner="fixed"),
    "dspark-threshold": dict(speculative_algorithm="DSPARK", planner="threshold"),
    "dspark-throughput": dict(speculative_algorithm="DSPARK", planner="throughput"),
    "dspark-algorithm1": dict(speculative_algorithm="DSPARK", planner="throughput", throughput_variant="algorithm1"),
}
REFERENCE_METHODS = ("hf", "hf-pld", "llama.cpp", *LLAMA_SERVER_METHODS)
ALIASES = {"dspark": ("dspark-fixed", "dspark-threshold", "dspark-throughput"), "plain": ("ar",)}
DEFAULT_METHODS = "ar,ngram,dflash,dspark,hf,hf-pld,llama.cpp"
DRAFTING = {"ngram", "dflash", "dspark-fixed", "dspark-threshold", "dspark-throughput", "dspark-algorithm1", "hf-pld",
            "llama.cpp-dspark", "llama.cpp-dspark-pmin"}


def expand_methods(spec: str) -> list[str]:
    """'ar,dspark,hf' -> ['ar', 'dspark-fixed', ..., 'hf']; ValueError for an unknown name."""
    names: list[str] = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        for name in ALIASES.get(raw, (raw,)):
            if name not in ENGINE_METHODS and name not in REFERENCE_METHODS:
                known = ", ".join([*ENGINE_METHODS, *ALIASES, *REFERENCE_METHODS])
                raise ValueError(f"unknown method {raw!r}; known: {known}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no methods given")
    return names


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class Completion:
    """One prompt's result."""

    token_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # committed tokens per round (engine only)
    windows: list[int] | None = None  # drafts verified per round (engine only)
    confidences: list[list[float]] | None = None  # the drafter's confidence row per round (engine only)
    ttft: float | None = None  # seconds from submission to the first token
    tpot: float | None = None  # seconds per output token after the first
    drafted: int | None = None  # drafts verified (methods that report them without per-round data)
    accepted: int | None = None  # ... and accepted


@dataclass
class BatchRun:
    """A group of prompts through one method: completions in prompt order, wall time, time split."""

    completions: list[Completion]
    seconds: float
    split: dict[str, float] = field(default_factory=dict)  # draft / plan / verify seconds (engine only)
    verify_steps: int | None = None  # verification rounds, for methods without per-round data (llama-server)


@dataclass(frozen=True)
class Setup:
    """What every method of one suite shares."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    device: str = "cpu"
    dspark_draft: str | None = None
    dflash_draft: str | None = None
    draft_quantization: str = "auto"  # both drafters' matrices (SpeculativeConfig.draft_quantization)
    sps_table: str | None = None
    sts_path: str | None = None
    threshold: float = 0.5
    verify_mode: str = "compact"
    max_num_seqs: int = 1
    kv_cache_mb: int = 256
    gguf: str | None = None
    llama_p_min: float | None = None  # llama.cpp-dspark-pmin's --spec-draft-p-min (default 0.5)


class EngineMethod:
    """An (algorithm, planner) pair through dspark's engine; closed loop at a given concurrency."""

    def __init__(self, name: str, setup: Setup, block_size: int | None = None, **overrides):
        self.name = name
        kw = {**ENGINE_METHODS.get(name, {}), **overrides}
        algo = kw.get("speculative_algorithm", "NONE")
        if algo in ("DSPARK", "DFLASH"):
            kw.setdefault("draft_model", setup.dspark_draft if algo == "DSPARK" else setup.dflash_draft)
            kw.setdefault("sts_path", setup.sts_path if algo == "DSPARK" else None)
            kw.setdefault("draft_quantization", setup.draft_quantization)
        if algo == "DSPARK":
            kw.setdefault("threshold", setup.threshold)
        if algo != "NONE":
            kw.setdefault("num_speculative_tokens", block_size)
            kw.setdefault("verify_mode", setup.verify_mode)
        from dspark import LLM
        from dspark.config import EngineConfig

        if EngineConfig.from_kwargs(**kw).speculative.plans_throughput:
            kw.setdefault("sps_table", setup.sps_table)  # only the throughput planner reads it

        self.llm = LLM(setup.model, dtype=setup.dtype, quantization=setup.quantization, device=setup.device,
                       max_num_seqs=setup.max_num_seqs,
                       kv_cache_mb=setup.kv_cache_mb, profile_progress=False, **kw)
        self.tokenizer = self.llm.tokenizer

    @property
    def draft_vocab(self):
        """The target ids the method's drafter can propose (None: no drafter, or its full vocabulary)."""
        drafter = getattr(self.llm.engine.proposer, "drafter", None)
        return getattr(drafter, "d2t", None)

    def run(self, prompts: list[list[int]], params: list[SamplingParams], concurrency: int = 1) -> BatchRun:
        """Closed loop: keep `concurrency` requests in flight until every prompt is done."""
        engine = self.llm.engine
        before = (engine.stats.time_draft, engine.stats.time_plan, engine.stats.time_verify)
        pending = deque(range(len(prompts)))
        active: dict[str, int] = {}
        outs: list = [None] * len(prompts)
        t0 = time.perf_counter()
        while pending or active:
            while pending and len(active) < concurrency:
                i = pending.popleft()
                active[engine.add_request(prompts[i], params[i])] = i
            for out in engine.step():
                if out.finished:
                    outs[active.pop(out.request_id)] = out
        seconds = time.perf_counter() - t0
        st = engine.stats
        split = {"draft": st.time_draft - before[0], "plan": st.time_plan - before[1],
                 "verify": st.time_verify - before[2]}
        return BatchRun([self._completion(o) for o in outs], seconds, split)

    def _completion(self, out) -> Completion:
        m = out.metrics
        windows = out.verify_lengths  # drafts verified per round, in the order of accept_lengths
        first, arrival, finish = m.get("first_token_time"), m.get("arrival"), m.get("finish_time")
        n = len(out.token_ids)
        return Completion(list(out.token_ids), list(out.accept_lengths), list(windows), list(out.draft_confidences),
                          ttft=first - arrival if first and arrival else None,
                          tpot=(finish - first) / (n - 1) if first and finish and n > 1 else None)


class HFMethod:
    """transformers' generate(), batch 1, optionally with prompt lookup (its n-gram speculation)."""

    def __init__(self, name: str, setup: Setup, block_size: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dspark.models.embedded import resolve_model_path
        from dspark.models.loader import resolve_dtype

        path = resolve_model_path(setup.model)
        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # "auto" gives transformers its own fastest CPU setting, fp32 (its bf16 matmuls re-pack weights each call)
        dtype = "float32" if setup.dtype == "auto" and setup.device == "cpu" else setup.dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, setup.device))
        self.model.to(setup.device)
        self.model.eval()
        self.lookup = (block_size or 7) if name == "hf-pld" else None
        eos = {self.tokenizer.eos_token_id}
        for src in (self.model.config.eos_token_id, self.model.generation_config.eos_token_id):
            eos |= set(src) if isinstance(src, (list, tuple)) else {src}
        self.eos = sorted(e for e in eos if e is not None)

    def run(self, prompts: list[list[int]], params: list[SamplingParams], concurrency: int = 1) -> BatchRun:
        import torch

        comps, t0 = [], time.perf_counter()
        for ids, p in zip(prompts, params):
            kw = dict(max_new_tokens=p.max_tokens, eos_token_id=self.eos, pad_token_id=self.eos[0],
                      do_sample=not p.greedy)
            if not p.greedy:
                kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else None)
                torch.manual_seed(p.seed or 0)
            if self.lookup:
                kw["prompt_lookup_num_tokens"] = self.lookup
            x = torch.tensor([ids], device=self.model.device)
            t = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
            comps.append(Completion(out, tpot=(time.perf_counter() - t) / max(1, len(out))))
        return BatchRun(comps, time.perf_counter() - t0)


class LlamaCppMethod:
    """llama.cpp through llama-cpp-python (only when installed), on the GGUF of the target."""

    def __init__(self, name: str, setup: Setup, block_size: int | None = None):
        import llama_cpp
        import torch

        self.name = name
        self.llama = llama_cpp.Llama(model_path=str(target_gguf(setup)), n_ctx=4096,
                                     n_threads=torch.get_num_threads(), verbose=False)
        self.eos = self.llama.token_eos()

    def run(self, prompts: list[list[int]], params: list[SamplingParams], concurrency: int = 1) -> BatchRun:
        comps, t0 = [], time.perf_counter()
        for ids, p in zip(prompts, params):
            if not p.greedy and p.seed is not None:
                self.llama.set_seed(p.seed)
            sampling = dict(temp=p.temperature, top_k=p.top_k if p.top_k > 0 else (1 if p.greedy else 0),
                            top_p=p.top_p, min_p=0.0, repeat_penalty=1.0)
            out: list[int] = []
            t = time.perf_counter()
            first = None
            for tok in self.llama.generate(ids, reset=True, **sampling):
                first = first or time.perf_counter()
                out.append(int(tok))
                if (tok == self.eos and not p.ignore_eos) or len(out) >= p.max_tokens:
                    break
            end = time.perf_counter()
            comps.append(Completion(out, ttft=first - t if first else None,
                                    tpot=(end - first) / (len(out) - 1) if first and len(out) > 1 else None))
        return BatchRun(comps, time.perf_counter() - t0)


def target_gguf(setup: Setup) -> Path:
    """The target as a GGUF for llama.cpp: --gguf, else the embedded model's own."""
    from dspark.models.embedded import find_gguf

    if setup.gguf:
        return Path(setup.gguf)
    if setup.model in (None, "", "embedded"):
        return find_gguf()
    raise ValueError("llama.cpp needs --gguf PATH for a model other than the embedded one")


def build_method(name: str, setup: Setup, block_size: int | None = None):
    """An EngineMethod, HFMethod, LlamaCppMethod or LlamaServerMethod by name."""
    if name in ENGINE_METHODS:
        return EngineMethod(name, setup, block_size)
    if name in ("hf", "hf-pld"):
        return HFMethod(name, setup, block_size)
    if name == "llama.cpp":
        if not llama_cpp_available():
            raise ModuleNotFoundError("llama-cpp-python is not installed")
        return LlamaCppMethod(name, setup, block_size)
    if name in LLAMA_SERVER_METHODS:
        from dspark.bench.llama_server import LlamaServerMethod

        return LlamaServerMethod(name, setup, block_size)
    raise ValueError(f"unknown method {name!r}")


@contextlib.contextmanager
def shared_target():
    """Within this block every LLM(...) of the same model, dtype and device shares one copy of the
    target weights (engines keep their own KV caches), so all methods fit in memory side by side."""
    import dspark.llm as llm_module

    original = llm_module.load_decoder
    loaded: dict = {}

    def load(path, **kw):
        key = (str(Path(path).resolve()), tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in loaded:
            loaded[key] = original(path, **kw)
        return loaded[key]

    llm_module.load_decoder = load
    try:
        yield
    finally:
        llm_module.load_decoder = original
