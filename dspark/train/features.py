"""Target features for training: chosen layers' hidden states and the teacher-forced top-K of p_t."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dspark.train.datagen import shard_paths

FEAT = "feat_{}.pt"  # next to shard_XXXXX.pt: feat_shard_XXXXX.pt


@dataclass
class SeqFeatures:
    """One sequence ready for the trainer: ids [L], loss mask [L], hidden [L, m*d], p_t top-K at each row."""

    ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L], True on assistant tokens
    hidden: torch.Tensor  # [L, m*d] (bf16 when cached): outputs of the chosen target layers
    top_ids: torch.Tensor  # int64 [L, K]: row i = the K most likely targets for position i+1
    top_probs: torch.Tensor  # fp32 [L, K]: their probabilities under the target (softmax at T=1)


@torch.no_grad()
def target_features(decoder, seqs: Sequence[torch.Tensor], layers: Sequence[int], topk: int,
                    max_tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Teacher-forced target pass over whole sequences -> per sequence (hidden, top_ids, top_probs)."""
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    i = 0
    while i < len(seqs):
        group = [seqs[i]]
        total = len(seqs[i])
        while i + len(group) < len(seqs) and total + len(seqs[i + len(group)]) <= max_tokens:
            total += len(seqs[i + len(group)])
            group.append(seqs[i + len(group)])
        out += _forward_group(decoder, group, layers, topk)
        i += len(group)
    return out


def _forward_group(decoder, group: list[torch.Tensor], layers: Sequence[int], topk: int):
    """One ragged prefill of several sequences through a throwaway paged cache."""
    lens = [len(s) for s in group]
    block = 16
    cache = decoder.new_cache(sum((n + block - 1) // block for n in lens) + 1, block_size=block)
    names = [f"s{j}" for j in range(len(group))]
    for name, n in zip(names, lens):
        cache.reserve(name, n)
    meta = cache.prepare(names, lens)
    ids = torch.cat(list(group)).to(decoder.device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(decoder.device)
    res = decoder(ids, pos, cache, meta, logits_rows=torch.arange(len(ids), device=decoder.device),
                  hidden_layers=tuple(layers))
    probs = torch.softmax(res.logits.float(), dim=-1)
    top_p, top_i = probs.topk(topk, dim=-1)
    return list(zip(res.hidden.split(lens), top_i.split(lens), top_p.split(lens)))


def cache_features(data_dir: str | Path, cache_dir: str | Path, decoder, layers: Sequence[int], topk: int,
                   log=print, max_shards: int | None = None) -> None:
    """Write feat_shard_XXXXX.pt (bf16 hidden, top-K p_t) for every shard not cached yet (resumable)."""
    data_dir, cache_dir = Path(data_dir), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    info = {"layers": list(layers), "topk": topk,
            "target": decoder.weight_format}
    meta_path = cache_dir / "features.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != info:
        raise ValueError(f"{cache_dir} holds features for {meta_path.read_text().strip()}, not {info}")
    meta_path.write_text(json.dumps(info) + "\n")
    for shard in shard_paths(data_dir, max_shards):
        path = cache_dir / FEAT.format(shard.stem)
        if path.exists():
            continue
        t0 = time.perf_counter()
        s = torch.load(shard)
        off = s["offsets"].tolist()
        seqs = [s["tokens"][off[j]:off[j + 1]].long() for j in range(len(off) - 1)]
        feats = target_features(decoder, seqs, layers, topk)
        blob = {"hidden": [h.to(torch.bfloat16).clone() for h, _, _ in feats],
                "top_ids": [t.to(torch.int32).clone() for _, t, _ in feats],
                "top_probs": [p.to(torch.float16).clone() for _, _, p in feats]}
        tmp = path.with_suffix(".tmp")
        torch.save(blob, tmp)
        tmp.replace(path)
        n = sum(len(x) for x in seqs)
        dt = time.perf_counter() - t0
        log(f"{path.name}: {n} tokens in {dt:.0f} s ({n / dt:.0f} tok/s)")


def load_cached(data_dir: str | Path, cache_dir: str | Path, max_shards: int | None = None) -> list[SeqFeatures]:
    """Every cached sequence (shards without features are skipped)."""
    out = []
    for shard in shard_paths(data_dir, max_shards):
        fpath = Path(cache_dir) / FEAT.format(shard.stem)
        if not fpath.exists():
            continue
        s, f = torch.load(shard), torch.load(fpath)
        off = s["offsets"].tolist()
        for j in range(len(off) - 1):
            ids = s["tokens"][off[j]:off[j + 1]].long()
            mask = torch.arange(len(ids)) >= int(s["prompt_lens"][j])
            out.append(SeqFeatures(ids, mask, f["hidden"][j], f["top_ids"][j].long(), f["top_probs"][j].float()))
    return out
