"""Multi-turn conversations as training text: ShareGPT chats rendered with the target's chat template,
the loss on every assistant turn. No generation: the trainer's target pass labels every position with
the target's own greedy token, so the text only has to be a realistic context."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from dspark.train.datagen import MANIFEST, SHARD, _write_json, mostly_ascii, sharegpt_rows

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
FORMAT = "dspark-train-text/1"


def sharegpt_chats(limit: int | None = None, min_chars: int = 16) -> Iterator[list[dict[str, str]]]:
    """ShareGPT conversations as chat messages: user first, roles alternating, mostly-ASCII, no empty turn."""
    taken = 0
    for row in sharegpt_rows():
        if limit is not None and taken >= limit:
            return
        msgs = [{"role": ROLES.get(t.get("from", ""), ""), "content": (t.get("value") or "").strip()}
                for t in row.get("conversations") or []]
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()
        if (len(msgs) < 2 or any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(msgs))
                or any(len(m["content"]) < 2 for m in msgs) or len(msgs[0]["content"]) < min_chars
                or not mostly_ascii("".join(m["content"] for m in msgs))):
            continue
        taken += 1
        yield msgs


def tokenize_chat(tokenizer, msgs: list[dict[str, str]], max_len: int) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and a loss mask on each assistant turn (its end-of-turn
    token included), from the lengths of the rendered prefixes; cut to max_len tokens."""
    def ids(prefix: list[dict[str, str]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(prefix, tokenize=True, add_generation_prompt=gen)
        return list(getattr(out, "input_ids", out) if not isinstance(out, dict) else out["input_ids"])

    full = ids(msgs, False)
    mask = [False] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(ids(msgs[:i], True))
        if start >= max_len:
            break
        end = len(ids(msgs[:i + 1], False))
        for j in range(start, min(end, len(full))):
            mask[j] = True
    return full[:max_len], mask[:max_len]


def write_chat_shards(out_dir: str | Path, tokenizer, chats: Iterator[list[dict[str, str]]], *, source: str,
                      shard_size: int = 256, max_len: int = 1024, log=print) -> dict[str, Any]:
    """Tokenize conversations into shard_*.pt files (tokens, offsets, loss_mask, ...); shards already on
    disk are kept, so a rerun with the same arguments only writes what is missing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = {"source": source, "shard_size": shard_size, "max_len": max_len, "chat_template": True,
              "tokenizer": getattr(tokenizer, "name_or_path", "")}
    man_path = out / MANIFEST
    manifest = json.loads(man_path.read_text()) if man_path.exists() else \
        {"format": FORMAT, "recipe": recipe, "shards": {},
         "loss_mask": "every assistant turn, its end-of-turn token included"}
    if manifest["recipe"] != recipe:
        raise ValueError(f"{man_path} was written with a different recipe; use a new output dir\n"
                         f"  existing: {manifest['recipe']}\n  now:      {recipe}")
    batch: list[tuple[list[int], list[bool]]] = []
    index, t0 = 0, time.perf_counter()

    def flush() -> None:
        nonlocal batch, index, t0
        path = out / SHARD.format(index)
        if not path.exists():
            toks = [t for ids, _ in batch for t in ids]
            mask = [m for _, ms in batch for m in ms]
            offsets = [0]
            for ids, _ in batch:
                offsets.append(offsets[-1] + len(ids))
            stats = {"sequences": len(batch), "response_tokens": sum(mask), "tokens": len(toks),
                     "seconds": round(time.perf_counter() - t0, 1)}
            shard = {"tokens": torch.tensor(toks, dtype=torch.int32), "offsets": torch.tensor(offsets),
                     "loss_mask": torch.tensor(mask, dtype=torch.bool),
                     "prompt_lens": torch.tensor([ms.index(True) for _, ms in batch]),
                     "sources": [source] * len(batch), "stats": stats}
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(shard, tmp)
            tmp.replace(path)
            manifest["shards"][path.name] = stats
            _write_json(man_path, manifest)
            log(f"{path.name}: {len(batch)} chats, {stats['response_tokens']} assistant tokens")
        batch, index, t0 = [], index + 1, time.perf_counter()

    for msgs in chats:
        ids, mask = tokenize_chat(tokenizer, msgs, max_len)
        if sum(mask) < 2:
            continue
        batch.append((ids, mask))
        if len(batch) == shard_size:
            flush()
    if batch:
        flush()
    return manifest
