"""Measure the target's steps/second per verify batch size (tokens): the SPS table the throughput
planner reads. Cached under $DSPARK_HOME/sps keyed by model, dtype and weight format, threads, device
and torch version."""
from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.models.decoder import Decoder
from dspark.models.embedded import dspark_home
from dspark.spec.cost_table import SPSTable


def default_sizes(max_tokens: int) -> list[int]:
    """Every size up to 16 (where kernel switches live), then a coarser grid up to max_tokens."""
    sizes = list(range(1, min(max_tokens, 16) + 1))
    s = 16
    while s < max_tokens:
        s = min(max_tokens, int(s * 1.5))
        sizes.append(s)
    return sizes


@torch.inference_mode()
def profile_sps(decoder: Decoder, sizes: list[int], *, context: int = 128, repeats: int = 5,
                progress: bool = True, name: str = "") -> SPSTable:
    """Median steps/s of one verify forward of B new tokens (logits on every row) over a `context`-token cache."""
    cache = decoder.new_cache(-(-(context + max(sizes)) // 16) + 1)
    dev = decoder.device
    cache.reserve("p", context + max(sizes))
    meta = cache.prepare(["p"], [context])
    gen = torch.Generator().manual_seed(0)
    vocab = decoder.config.vocab_size
    decoder(torch.randint(vocab, (context,), generator=gen).to(dev), torch.arange(context, device=dev), cache, meta)
    sps = {}
    for b in tqdm(sizes, desc="profiling target steps/s", disable=not progress, file=sys.stderr):
        ids = torch.randint(vocab, (b,), generator=gen).to(dev)
        pos = torch.arange(context, context + b, device=dev)
        rows = torch.arange(b, device=dev)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            cache.reserve("p", context + b)  # truncate() below hands the tail blocks back
            meta = cache.prepare(["p"], [b])
            t = time.perf_counter()
            decoder(ids, pos, cache, meta, logits_rows=rows)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            cache.truncate("p", context)
        sps[b] = 1.0 / statistics.median(times[1:])
    for small, big in zip(sizes, sizes[1:]):  # more tokens never take less time: a faster reading
        sps[big] = min(sps[big], sps[small])  # at a bigger size is timing noise, and would lure the planner
    return SPSTable(sps, model=name, dtype=decoder.weight_format,
                    threads=torch.get_num_threads(), torch_version=torch.__version__, device=str(dev))


def table_cache_path(model_path: Path, decoder: Decoder, max_tokens: int) -> Path:
    """Where the cached table for this model / dtype / threads / device / torch version lives."""
    key = "|".join([str(Path(model_path).resolve()), decoder.weight_format, str(torch.get_num_threads()),
                    str(decoder.device), torch.__version__, str(max_tokens)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return dspark_home() / "sps" / f"{Path(model_path).name}-{digest}.json"


def load_or_profile(model_path: Path, decoder: Decoder, max_tokens: int, *, progress: bool = True) -> SPSTable:
    """The cached SPS table for this set-up, profiling once (seconds) if there is none."""
    path = table_cache_path(model_path, decoder, max_tokens)
    if path.is_file():
        try:
            return SPSTable.load(path)
        except ValueError:
            pass  # a damaged cache entry: measure again
    table = profile_sps(decoder, default_sizes(max_tokens), progress=progress, name=Path(model_path).name)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    return table


@torch.inference_mode()
def profile_drafting(drafter, sizes: list[int], *, context: int = 128, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one drafting pass (one block per request) for each batch size in `sizes`,
    over `context` cached positions per request. Measured once when the planner is built, so that
    its skip-the-drafter decisions stay reproducible within a run."""
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    cache = drafter.new_cache(context + 8)
    drafter.extend(cache, torch.randn(context, width, generator=gen).to(dev, dtype), 0)
    out = {}
    for r in sizes:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            t = time.perf_counter()
            drafter.draft([cache] * r, [1] * r, [context] * r)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[r] = statistics.median(times[1:])
    return out
