"""Measure the target's steps/second per verify batch (tokens, and sequences sharing the step): the SPS
table the throughput planner reads. Cached under $DSPARK_HOME/sps keyed by model, dtype and weight
format, threads, device, torch version and the largest batch profiled."""
from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.cache import blocks_for
from dspark.host import cpu_identity
from dspark.models import native, native_avx2
from dspark.models.attention import KV_ALIGN
from dspark.models.decoder import Decoder
from dspark.models.embedded import dspark_home
from dspark.speculative.config import SpsProfile, choices
from dspark.speculative.cost_table import SPSTable


def default_sizes(max_tokens: int) -> list[int]:
    """Every size up to 16 (where kernel switches live), then a coarser grid up to max_tokens."""
    sizes = list(range(1, min(max_tokens, 16) + 1))
    s = 16
    while s < max_tokens:
        s = min(max_tokens, int(s * 1.5))
        sizes.append(s)
    return sizes


EXTRA_TOKENS = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # drafts per loaded step that get measured
# "quick": the grid a first start measures so that a server answers within seconds: fewer sizes, loaded
# steps of 2, 8 and the most sequences only, one timed pass. The planner interpolates between points,
# so it prices steps a little more coarsely; `full` (or `dspark profile`) measures everything.
QUICK_EXTRA_TOKENS = (0, 2, 8, 32)


def quick_sizes(max_tokens: int) -> list[int]:
    """1..8, 16 and 32 (those up to max_tokens): past the last point the table extends the step time
    linearly in tokens, which is what a compute-bound step does; a 256-token step alone cost a third of
    the full grid's time on a 2-core AVX2 CPU."""
    return [s for s in (*range(1, 9), 16, 32) if s <= max_tokens]


def quick_seq_counts(max_seqs: int) -> list[int]:
    """2, 8 and max_seqs (those up to max_seqs)."""
    return sorted({r for r in (2, 8, max_seqs) if 2 <= r <= max_seqs})


def default_seq_counts(max_seqs: int) -> list[int]:
    """Sequence counts (>= 2) to profile loaded steps at: powers of two up to max_seqs, and max_seqs."""
    counts, r = [], 2
    while r < max_seqs:
        counts.append(r)
        r *= 2
    return counts + [max_seqs] if max_seqs >= 2 else []


def _windows(seqs: int, tokens: int, width: int) -> list[int]:
    """Window lengths of a step of `tokens` over `seqs` sequences: one anchor each, drafts filling
    whole windows of `width` in turn (the planner's top-K picks the most confident requests first)."""
    lens, extra = [1] * seqs, tokens - seqs
    for i in range(seqs):
        add = min(extra, width - 1)
        lens[i] += add
        extra -= add
    lens[-1] += extra  # only when tokens > seqs * width: more than the windows hold
    return lens


@torch.inference_mode()
def profile_sps(decoder: Decoder, sizes: list[int], *, seq_counts: list[int] = (), window: int = 8,
                context: int = 256, repeats: int = 4, progress: bool = True, name: str = "",
                extra_tokens: tuple[int, ...] = EXTRA_TOKENS, light_warmup: bool = False) -> SPSTable:
    """Median steps/s of one verify forward (logits on every row) over `context` cached tokens per
    sequence: B new tokens of one sequence for B in `sizes`, and for each R in `seq_counts` a loaded
    step of R sequences with 0..R * (window - 1) drafts (`extra_tokens`). The cached keys are not
    computed (attention costs the same whatever their values). The most loaded plain step is also
    timed at twice the context: the table's kv_seconds, the step time per cached token, lets the
    planner price steps over shorter or longer contexts. Every point is timed once per pass, after a
    warm-up pass: a slow spell of a shared machine then hits all points alike instead of bending the
    curve. With light_warmup the warm-up pass runs only the first step of each sequence count and the
    biggest step (code paths and buffers), not every point."""
    seq_counts = sorted({r for r in seq_counts if r >= 2})
    points = [[b] for b in sizes]
    points += [_windows(r, r + e, window) for r in seq_counts for e in extra_tokens if e <= r * (window - 1)]
    widest = max(seq_counts, default=1)
    jobs = [(lens, context) for lens in points] + [([1] * widest, context), ([1] * widest, 2 * context)]
    biggest = max(sum(lens) for lens in points)
    per_seq = blocks_for(2 * context + biggest)
    cache = decoder.new_cache(per_seq * (1 + widest) + 1)
    gen = torch.Generator().manual_seed(0)
    times: list[list[float]] = [[] for _ in jobs]
    warm = set(range(len(jobs)))
    if light_warmup:
        first = {len(lens): i for i, (lens, _) in reversed(list(enumerate(jobs)))}
        warm = set(first.values()) | {max(range(len(jobs)), key=lambda i: sum(jobs[i][0]))}
    with tqdm(total=len(warm) + len(jobs) * repeats, desc="profiling target steps/s", disable=not progress,
              file=sys.stderr) as bar:
        for p in range(repeats + 1):  # pass 0 warms up
            for i, (lens, ctx) in enumerate(jobs):
                if not p and i not in warm:
                    continue
                elapsed = _time_step(decoder, cache, lens, ctx, gen)
                if p:
                    times[i].append(elapsed)
                bar.update()
    kv_seconds = max(0.0, statistics.median(times[-1]) - statistics.median(times[-2])) / (widest * context)
    sps: dict[int, float] = {}
    by_seqs: dict[int, dict[int, float]] = {}
    for lens, t in zip(points, times):
        (sps if len(lens) == 1 else by_seqs.setdefault(len(lens), {}))[sum(lens)] = 1.0 / statistics.median(t)
    return SPSTable(_monotone(sps), by_seqs={r: _monotone(pts) for r, pts in by_seqs.items()}, context=context,
                    kv_seconds=kv_seconds, model=name,
                    dtype=decoder.weight_format, threads=torch.get_num_threads(), torch_version=torch.__version__,
                    device=str(decoder.device))


def _time_step(decoder: Decoder, cache, lens: list[int], ctx: int, gen: torch.Generator,
               hidden_layers: tuple[int, ...] = ()) -> float:
    """Seconds of one verify forward: sequence r of `cache` appends lens[r] random tokens after `ctx`
    cached positions (marked written, not computed), logits on every row (and the hidden_layers tapped,
    as for a drafter); the cache is put back."""
    dev, total = decoder.device, sum(lens)
    ids = torch.randint(decoder.config.vocab_size, (total,), generator=gen).to(dev)
    pos = torch.cat([torch.arange(ctx, ctx + n) for n in lens]).to(dev)
    for r, n in enumerate(lens):
        if cache.length(r) > ctx:
            cache.truncate(r, ctx)
        elif cache.length(r) < ctx:  # mark the context as written (its values do not matter)
            cache.reserve(r, ctx)
            cache.prepare([r], [ctx - cache.length(r)])
        cache.reserve(r, ctx + n)  # truncate() below hands the tail blocks back
    meta = cache.prepare(list(range(len(lens))), lens)
    t = time.perf_counter()
    decoder(ids, pos, cache, meta, logits_rows=torch.arange(total, device=dev), hidden_layers=hidden_layers)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    for r in range(len(lens)):
        cache.truncate(r, ctx)
    return elapsed


def _monotone(points: dict[int, float]) -> dict[int, float]:
    """More tokens never take less time: a faster reading at a bigger size is timing noise, and would
    lure the planner."""
    out, best = {}, float("inf")
    for size in sorted(points):
        best = min(best, points[size])
        out[size] = best
    return out


def table_cache_path(model_path: Path, decoder: Decoder, max_tokens: int, max_seqs: int = 1,
                     profile: str = "full") -> Path:
    """Where the cached table for this model / dtype / kernels / threads / device / CPU / torch version lives."""
    key = "|".join([str(Path(model_path).resolve()), decoder.weight_format, str(torch.get_num_threads()),
                    str(decoder.device), cpu_identity(), torch.__version__, str(max_tokens), f"seqs={max_seqs}",
                    "ctx=256"]
                   + ([f"dspark-kernels-{native.build_key()}"] if getattr(decoder, "kernels", False) else [])
                   + ([f"dspark-avx2-{native_avx2.build_key()}"] if native_avx2.build_key() else [])
                   + ([] if profile == "full" else [profile]))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return dspark_home() / "sps" / f"{Path(model_path).name}-{digest}.json"


def load_or_profile(model_path: Path, decoder: Decoder, max_tokens: int, *, max_seqs: int = 1, window: int = 8,
                    progress: bool = True, profile: str = "full") -> SPSTable:
    """The cached SPS table for this set-up (one-sequence steps up to max_tokens, loaded steps of up to
    max_seqs sequences with windows up to `window` tokens), profiling once if there is none. A cached
    full table is used whatever `profile` asks; with "quick" and none cached, the quick grid is measured
    (and cached apart), which takes seconds where the full one takes a minute or more."""
    if profile not in choices(SpsProfile):
        raise ValueError(f"sps profile must be one of {', '.join(choices(SpsProfile))}, got {profile!r}")
    for kind in dict.fromkeys(("full", profile)):
        cached = table_cache_path(model_path, decoder, max_tokens, max_seqs, kind)
        if cached.is_file():
            try:
                return SPSTable.load(cached)
            except ValueError:
                pass  # a damaged cache entry: measure again
    path = table_cache_path(model_path, decoder, max_tokens, max_seqs, profile)
    table = measure_sps(decoder, max_tokens=max_tokens, max_seqs=max_seqs, window=window, profile=profile,
                        progress=progress, name=Path(model_path).name)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    return table


def measure_sps(decoder: Decoder, *, max_tokens: int, max_seqs: int = 1, window: int = 8, profile: str = "full",
                repeats: int | None = None, context: int = 256, progress: bool = True, name: str = "") -> SPSTable:
    """The one producer of SPS tables (a start with none cached, `dspark profile`, `dspark bench roofline`):
    one-sequence steps up to max_tokens and loaded steps of 2..max_seqs sequences with windows up to
    `window`, on the full grid or the quick one. repeats: timed passes (default 4 full, 1 quick)."""
    if profile == "quick":
        return profile_sps(decoder, quick_sizes(max_tokens), seq_counts=quick_seq_counts(max_seqs), window=window,
                           repeats=repeats or 1, context=context, progress=progress, name=name,
                           extra_tokens=QUICK_EXTRA_TOKENS, light_warmup=True)
    return profile_sps(decoder, default_sizes(max_tokens), seq_counts=default_seq_counts(max_seqs), window=window,
                       repeats=repeats or 4, context=context, progress=progress, name=name)


def drafting_grid(max_seqs: int, profile: str = "full") -> tuple[list[int], int]:
    """(batch sizes, timed passes) at which a start times drafting rounds: 1, 2, 4, ..., 32 and max_seqs
    in five passes; with "quick", 1, 8 and max_seqs in two."""
    sizes = {1, 8, max_seqs} if profile == "quick" else {1, 2, 4, 8, 16, 32, max_seqs}
    return sorted(r for r in sizes if 1 <= r <= max_seqs), 2 if profile == "quick" else 5


@torch.inference_mode()
def profile_drafting(drafter, sizes: list[int], *, decoder: Decoder | None = None, table: SPSTable | None = None,
                     context: int = 256, fed: int = 2, repeats: int = 5,
                     num_drafts: int | None = None) -> dict[int, float]:
    """Seconds of one drafting round for each batch size in `sizes`: feeding `fed` newly committed
    positions per request into the drafter's context (one packed projection), then one block per
    request over `context` cached positions (its first `num_drafts` drafts; default the whole block).
    Median of `repeats` passes after a warm-up pass.

    With `decoder` and `table`, every drafting round is timed right after a plain one-token target
    step, as it runs in the engine (the step has just pushed the drafter's weights out of the CPU
    caches), and the result is that round's cost as a fraction of the step, priced in the table's
    step time. The table may be cached from an earlier run on a machine that was faster or slower
    then; the ratio is what carries over. Measured once when the planner is built, so its
    skip-the-drafter decisions stay reproducible within a run."""
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    widest = max(sizes)
    hidden = torch.randn(context, width, generator=gen).to(dev, dtype)
    caches = [drafter.new_cache(context + fed + 8) for _ in range(widest)]
    drafter.extend_many(caches, [hidden] * widest, [0] * widest)
    paired = decoder is not None and table is not None
    # room for the key axis's padding too, so the step reads its keys as one view of consecutive rows
    # (and runs fused at batch 1) as the engine's steps do, rather than through a gather
    target = decoder.new_cache(blocks_for(context + 1 + KV_ALIGN) + 1) if paired else None
    steps: list[float] = []
    times: dict[int, list[float]] = {r: [] for r in sizes}
    start = context - fed
    for p in range(repeats + 1):  # pass 0 warms up
        for r in sizes:
            if paired:
                step = _time_step(decoder, target, [1], context, gen)
                if p:
                    steps.append(step)
            t = time.perf_counter()
            drafter.extend_many(caches[:r], [hidden[start:]] * r, [start] * r)
            drafter.draft(caches[:r], [1] * r, [context] * r, num_drafts=num_drafts, return_logits=False)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if p:
                times[r].append(time.perf_counter() - t)
    scale = 1.0 / (statistics.median(steps) * table.sps(1, 1, context)) if paired else 1.0
    return {r: statistics.median(t) * scale for r, t in times.items()}
