"""The memory roofline of plain decoding and the SPS curve.

Batch-1 decoding reads every weight once per token, so weight bytes / read bandwidth bounds plain
decoding from above; speculative methods can pass that ceiling (several tokens per weight read), and
where each method sits against it says how much of the machine it uses.
"""
from __future__ import annotations

import time

import torch

from dspark.speculative.cost_table import SPSTable


def read_bandwidth_gbs(mb: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """Memory read bandwidth: best of `repeats` sums over a buffer far larger than the caches."""
    x = torch.ones(mb * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    x.sum()  # first touch
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear (packed copies included, a tied LM head
    once) and norm, but not embedding tables, of which a step reads one row per token."""
    from dspark.models.int4 import Int4Linear
    from dspark.models.packing import PackedLinear
    from dspark.models.q8 import Q8Linear

    seen: set[int] = set()
    nbytes = 0
    q8_head = getattr(module, "lm_head_q8", None) is not None  # then the bf16 head is never read
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding) or (q8_head and m is module.lm_head):
            continue
        if isinstance(m, Int4Linear):
            tensors = [m.packed, m.scale_zero, m.bias]  # scale_zero is None with dspark's kernel
        elif isinstance(m, Q8Linear):
            tensors = [m.packed, m.bias]
        elif isinstance(m, PackedLinear):
            tensors = [m.packed, m.bias]
        else:
            tensors = list(m.parameters(recurse=False))
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                nbytes += t.numel() * t.element_size()
    return nbytes


def ceiling_tokens_per_s(bandwidth_gbs: float, nbytes: int) -> float:
    """Plain-decode roofline: one full weight read per token."""
    return bandwidth_gbs * 1e9 / nbytes


def run_roofline(model: str | None = None, *, dtype: str = "auto", quantization: str = "auto", device: str = "cpu",
                 sps_table: str | None = None, max_tokens: int = 64, repeats: int = 5,
                 bandwidth_mb: int = 256, context: int = 256, max_seqs: int = 1, window: int = 8,
                 save_sps: str | None = None, progress: bool = True) -> dict:
    """Measure bandwidth, weight bytes and the SPS table (or read it from `sps_table`): the 'roofline'
    section. The table is the planner's (speculative/profile.py: measure_sps), loaded steps of up to
    max_seqs sequences included; save_sps: also write it where the throughput planner (--sps-table) reads it."""
    from dspark.models.embedded import resolve_model_path
    from dspark.models.loader import load_decoder, resolve_dtype
    from dspark.speculative.profile import measure_sps

    path = resolve_model_path(model)
    decoder = load_decoder(path, dtype=resolve_dtype(dtype, device), device=device, pack=True,
                           quantization=quantization)
    nbytes = weight_bytes(decoder)
    bw = read_bandwidth_gbs(bandwidth_mb, device=device)
    if sps_table:
        table, source = SPSTable.load(sps_table), str(sps_table)
    else:
        table = measure_sps(decoder, max_tokens=max_tokens, max_seqs=max_seqs, window=window, repeats=repeats,
                            context=context, progress=progress, name=path.name)
        source = "measured"
    if save_sps:
        table.save(save_sps)
    return {"model": path.name, "dtype": dtype, "quantization": decoder.quantization, "device": device,
            "threads": torch.get_num_threads(),
            "bandwidth_gb_s": bw, "weight_bytes": nbytes, "ceiling_tokens_per_s": ceiling_tokens_per_s(bw, nbytes),
            "sps": {str(k): v for k, v in table.points.items()}, "sps_source": source}


def method_fractions(roofline: dict, cells: list[dict]) -> list[dict]:
    """Each batch-1 offline cell's tokens/s as a fraction of the plain-decode ceiling."""
    ceiling = roofline["ceiling_tokens_per_s"]
    return [{"label": c["label"], "dataset": c["dataset"], "temperature": c["temperature"],
             "tokens_per_s": c["tokens_per_s"]["median"], "fraction": c["tokens_per_s"]["median"] / ceiling}
            for c in cells if c["concurrency"] == 1 and c["tokens_per_s"]["median"]]
