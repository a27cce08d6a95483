"""The lossless race: the same prompts through plain decoding and one method, token for token.

The check to run before trusting a new drafter: a lossless method must reproduce plain greedy decoding
exactly; the race prints the first divergence with its context otherwise, and the speedup either way.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

from dspark.bench.acceptance import AcceptanceCounter
from dspark.sampling_params import SamplingParams


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_context(tokenizer, base: list[int], other: list[int], at: int, width: int = 12) -> dict:
    """The text just before the divergence and what each side wrote next."""
    show = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return {"token": at, "before": show(base[max(0, at - width): at]),
            "plain": show(base[at: at + width]), "method": show(other[at: at + width])}


def race_methods(args):
    """Plain decoding and the speculative method that the command's model and speculative flags name,
    sharing one loaded target: the two sides of `dspark bench race` and `dspark demo`."""
    from dspark.bench.methods import EngineMethod, Setup, shared_target
    from dspark.cli_args import engine_config, speculative_options

    spec = speculative_options(args)
    engine_config(spec)  # its checks, with the flags named, before any model loads
    algo = spec["speculative_algorithm"]
    label = algo.lower() + (f"-{spec['planner']}" if algo == "DSPARK" else "")
    setup = Setup(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                  kv_cache_mb=256)
    with shared_target():
        return EngineMethod("ar", setup), EngineMethod(label, setup, **spec)


def run_race(plain, method, prompts: list[tuple[str, list[int]]], max_tokens: int, tokenizer,
             progress: bool = True, warmup: int = 8) -> dict:
    """Greedy, batch 1, interleaved per prompt. prompts: (name, token ids). Each side first answers the
    first prompt with `warmup` tokens, untimed (one-time costs stay out of the speed). Returns the
    'race' section; each prompt's row carries both texts."""
    params = [SamplingParams(max_tokens=max_tokens)]
    if warmup and prompts:
        for m in (plain, method):
            m.run([prompts[0][1]], [SamplingParams(max_tokens=warmup)])
    seconds = {"plain": 0.0, "method": 0.0}
    tokens = {"plain": 0, "method": 0}
    acc = AcceptanceCounter()
    results = []
    for k, (name, ids) in enumerate(tqdm(prompts, desc="race", disable=not progress, file=sys.stderr)):
        sides = [("plain", plain), ("method", method)]
        out = {}
        for side, m in (sides if k % 2 == 0 else sides[::-1]):  # alternate who goes first
            run = m.run([ids], params)
            out[side] = run.completions[0]
            seconds[side] += run.seconds
            tokens[side] += len(out[side].token_ids)
        a, b = out["plain"].token_ids, out["method"].token_ids
        if out["method"].windows is not None:
            acc.add(out["method"].accept_lengths, out["method"].windows)
        at = first_divergence(a, b)
        row = {"prompt": name, "tokens": len(a), "identical": at is None,
               "plain_text": tokenizer.decode(a, skip_special_tokens=True),
               "method_text": tokenizer.decode(b, skip_special_tokens=True)}
        if at is not None:
            row["divergence"] = divergence_context(tokenizer, a, b, at)
        results.append(row)
    speed = {s: tokens[s] / seconds[s] if seconds[s] else 0.0 for s in seconds}
    return {"method": getattr(method, "name", "method"), "prompts": results,
            "identical": all(r["identical"] for r in results),
            "plain_tokens_per_s": speed["plain"], "method_tokens_per_s": speed["method"],
            "speedup": speed["method"] / speed["plain"] if speed["plain"] else None,
            "tau": acc.tau, "accept_by_position": acc.conditional()}


def format_race(race: dict) -> str:
    """The human verdict: one line per prompt, then lossless yes/no and the speedup."""
    lines = []
    for r in race["prompts"]:
        if r["identical"]:
            lines.append(f"  identical  {r['prompt']}  ({r['tokens']} tokens)")
        else:
            d = r["divergence"]
            lines.append(f"  DIVERGED   {r['prompt']}  at token {d['token']}\n"
                         f"     context: ...{d['before']!r}\n"
                         f"     plain  : {d['plain']!r}\n"
                         f"     {race['method']:<7}: {d['method']!r}")
    same = sum(r["identical"] for r in race["prompts"])
    verdict = "LOSSLESS" if race["identical"] else "NOT LOSSLESS"
    tau = f", mean accept length {race['tau']:.2f}" if race.get("tau") else ""
    lines.append(f"{verdict}: {same}/{len(race['prompts'])} prompts identical to plain decoding")
    lines.append(f"speed: plain {race['plain_tokens_per_s']:.1f} tokens/s, {race['method']} "
                 f"{race['method_tokens_per_s']:.1f} tokens/s, speedup {race['speedup'] or 0:.2f}x{tau}")
    return "\n".join(lines)
