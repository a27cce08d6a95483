"""Replay the throughput planner at batch 1 on recorded traces: planner settings compared without timing noise.

For each prompt: the target's greedy answer, then the drafter's block and (STS-calibrated) confidences at every
position of it, with its context fed from the served decoder's hidden states as the engine feeds it, and how
many of those drafts the answer keeps. Each planner variant then walks every answer round by round as the
engine does at batch 1 (draft or not, ask for its budget, plan a window, observe what survived) and each
round is priced by the planner's own cost model: the SPS table's step for the window, plus the drafting
round as measured at start-up (a fraction of a step). The traces are shared by every variant, so the
figures differ by policy alone. Wall-clock runs (`dspark bench offline --methods ar,dspark-throughput`)
stay the final word: the cost model is only as good as the SPS table and the drafting profile.

Variants: `base` (backoff and measured survival off: the planner before them), `default` (the engine's
defaults), and any `NAME:key=value,...` of ThroughputPlanner's keywords (probe_every, idle_probe_every,
variant, lag, min_gain, outlook_weight, backoff, measured_weight), plus plan_at_price=1: plan with the pricing table
(--per-draft or --price-table) instead of the engine's.

    .venv/bin/python bench/planner_replay.py [--draft-model DIR] [--num-prompts 10] [--max-tokens 128]
        [--variant NAME:key=value,...] [--sps-table JSON] [--traces FILE] [--json OUT]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

KEYS = {"plan_at_price": int, "variant": str, "lag": int, "probe_every": int, "idle_probe_every": int, "min_gain": float, "outlook_weight": float,
        "backoff": lambda v: v.lower() in ("1", "true", "yes"), "measured_weight": float}
BASE = {"backoff": False, "measured_weight": 0.0}


@dataclasses.dataclass
class Trace:
    """One answer: its length, and at each anchor (the answer's token j, drafting tokens j+1...) the
    drafter's confidences and how many of its drafts the answer keeps."""

    tokens: int
    conf: list[list[float]]
    keeps: list[int]


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:key=value,...' -> (name, ThroughputPlanner keywords); 'base' and 'default' are built in."""
    name, _, spec = text.partition(":")
    kw = dict(BASE) if name == "base" else {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"--variant {text!r}: unknown key {key!r}; known: {', '.join(KEYS)}")
        try:
            kw[key] = KEYS[key](value)
        except ValueError:
            raise SystemExit(f"--variant {text!r}: bad value for {key}: {value!r}") from None
    return name, kw


@torch.inference_mode()
def record(llm, prompts: list[list[int]], max_tokens: int) -> list[Trace]:
    """Greedy answers through the engine, then the drafter's blocks at every anchor of each answer."""
    from dspark import SamplingParams
    from dspark.train.dense_target import served_pass

    proposer = llm.engine.proposer
    drafter, gamma = proposer.drafter, proposer.max_drafts
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    traces = []
    for ids, out in zip(prompts, outs):
        answer = list(out.token_ids)
        full = torch.tensor(ids + answer)
        hidden = served_pass(llm.decoder, full, logits=False, hidden_layers=proposer.hidden_layers).hidden
        hidden = hidden.to(drafter.fc.weight.dtype)
        cache, fed = drafter.new_cache(len(full) + 8), 0
        conf, keeps = [], []
        for j in range(len(answer) - 1):  # anchor: answer token j, at position len(ids) + j
            pos = len(ids) + j
            drafter.extend_many([cache], [hidden[fed:pos]], [fed])
            fed = pos
            d = drafter.draft([cache], [answer[j]], [pos], num_drafts=gamma, return_logits=False)
            c = proposer.confidences(d.conf_logits)[0]
            drafts, truth = d.tokens[0].tolist(), answer[j + 1:]
            k = 0
            while k < min(len(drafts), len(truth)) and drafts[k] == truth[k]:
                k += 1
            conf.append(c)
            keeps.append(k)
        traces.append(Trace(tokens=len(answer), conf=conf, keeps=keeps))
    return traces


def linear_table(table, per_draft: float, widest: int = 64):
    """A one-sequence SPS table whose window of 1 + n tokens costs 1 + per_draft x n one-token steps."""
    from dspark.speculative.cost_table import SPSTable

    return SPSTable({b: table.sps(1, 1) / (1.0 + per_draft * (b - 1)) for b in range(1, widest + 1)})


def replay(planner, traces: list[Trace], gamma: int, price=None) -> dict:
    """Walk every answer as the engine would at batch 1 under `planner`; price each round by `price` (an SPS
    table; default the planner's own) plus the planner's drafting time."""
    table = price or planner.table
    step = 1.0 / table.sps(1, 1)
    seconds = plain = 0.0
    rounds = drafted = verified = accepted = committed = 0
    for i, tr in enumerate(traces):
        rid = f"p{i}"
        done = 1  # the first answer token comes from the prefill
        while done < tr.tokens:
            j = done - 1  # anchor: the last committed token
            rounds += 1
            window = kept = 0
            cost = 0.0
            if planner.should_draft([rid]):
                n = planner.num_drafts([rid], gamma)
                drafted += 1
                # the drafting round as the same fraction of a step in the pricing table as in the planner's
                cost += planner.draft_seconds(1, n) * planner.table.sps(1, 1) / table.sps(1, 1)
                row = tr.conf[j][:n]
                window = min(planner.plan([rid], [row])[0], n)
                kept = min(window, tr.keeps[j])
                planner.observe(rid, window, kept)
            cost += 1.0 / table.sps(1 + window, 1)
            take = min(kept + 1, tr.tokens - done)
            seconds += cost
            done += take
            verified += window
            accepted += kept
            committed += take
        plain += (tr.tokens - 1) * step
        planner.release(rid)
    return {"speedup": plain / seconds, "tau": committed / rounds, "rounds": rounds, "drafted_rounds": drafted,
            "verified": verified, "accepted": accepted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-model", default=None, help="a DSpark drafter directory (default: the shipped one)")
    p.add_argument("--dataset", default="bench/data/eval", help="eval sets (dspark bench offline's --dataset)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:key=value,... (repeatable; base and default always run)")
    p.add_argument("--draft-fraction", default=None, metavar="WHOLE,ONE",
                   help="price a batch-1 drafting round at these fractions of a one-token step (a whole block, "
                        "one draft) instead of the start-up measurement, which a busy host distorts")
    p.add_argument("--per-draft", type=float, default=None, metavar="F",
                   help="also price (and, in variants that say plan_at_price=1, plan) every window as 1 + F steps "
                        "per draft instead of by the SPS table")
    p.add_argument("--sps-table", default=None, metavar="JSON",
                   help="plan and price with this SPS table (e.g. one from `dspark profile`) instead of the cached one")
    p.add_argument("--price-table", default=None, metavar="JSON",
                   help="price every round by this SPS table (e.g. one from `dspark profile` on idle cores) instead "
                        "of the planner's; variants that say plan_at_price=1 also plan with it")
    p.add_argument("--traces", default=None, help="a file to keep the recorded traces in (reused when it exists)")
    p.add_argument("--json", default=None, help="write the table here too")
    args = p.parse_args()
    variants = [parse_variant(v) for v in ["base", "default", *args.variant]]

    from dspark import LLM
    from dspark.bench.datasets import load_datasets
    from dspark.bench.offline import encode_prompts
    from dspark.speculative.planners import ThroughputPlanner

    llm = LLM(speculative_algorithm="DSPARK", draft_model=args.draft_model, max_num_seqs=1, profile_progress=False,
              sps_table=args.sps_table)
    built = llm.engine.planner
    if not isinstance(built, ThroughputPlanner) or not built.draft_table:
        raise SystemExit("the engine built no throughput planner with drafting times")
    gamma = llm.engine.proposer.max_drafts
    common = dict(variant=built.variant, lag=built.lag, draft_seconds=built.draft_table,
                  draft_seconds_one=built.draft_one, block_size=built.block_size, probe_every=built.probe_every,
                  idle_probe_every=built.idle_probe_every, min_gain=built.min_gain,
                  outlook_weight=built.outlook_weight)
    if args.draft_fraction:
        whole, one = (float(x) for x in args.draft_fraction.split(","))
        step = 1.0 / built.table.sps(1, 1)
        common.update(draft_seconds={1: whole * step}, draft_seconds_one={1: one * step})
    prior = llm.engine.proposer.drafter.survival_prior
    results = {}
    stored = {}
    if args.traces and Path(args.traces).is_file():
        stored = {k: [Trace(**t) for t in v] for k, v in json.loads(Path(args.traces).read_text()).items()}
    if args.per_draft is not None and args.price_table:
        raise SystemExit("--per-draft and --price-table both set the price: give one")
    price = linear_table(built.table, args.per_draft) if args.per_draft is not None else None
    if args.price_table:
        from dspark.speculative.cost_table import SPSTable
        price = SPSTable.load(args.price_table)
    for ds in load_datasets([args.dataset], limit=args.num_prompts):
        if ds.name not in stored:
            stored[ds.name] = record(llm, encode_prompts(llm.tokenizer, ds.prompts, raw=False), args.max_tokens)
        for name, kw in variants:
            kw = dict(kw)
            table = price if kw.pop("plan_at_price", 0) and price is not None else built.table
            planner = ThroughputPlanner(table, prior=prior, **{**common, **kw})
            results.setdefault(ds.name, {})[name] = replay(planner, stored[ds.name], gamma, price)
    if args.traces:
        Path(args.traces).write_text(json.dumps({k: [dataclasses.asdict(t) for t in v] for k, v in stored.items()}))
    ref = ThroughputPlanner(built.table, **common)
    print(f"drafting round at batch 1: {ref.draft_seconds(1) * built.table.sps(1, 1):.3f} of a step "
          f"(one draft {ref.draft_seconds(1, 1) * built.table.sps(1, 1):.3f}); "
          f"window of 1 + 7 tokens: {built.table.sps(1, 1) / built.table.sps(8, 1):.2f} steps")
    print("| set | variant | modeled speedup | tau | rounds | drafting rounds | verified | accepted |")
    print("|---|---|---|---|---|---|---|---|")
    for ds, by in results.items():
        for name, r in by.items():
            print(f"| {ds} | {name} | {r['speedup']:.3f}x | {r['tau']:.2f} | {r['rounds']} | {r['drafted_rounds']} "
                  f"| {r['verified']} | {r['accepted']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": dict(variants), "results": results}, indent=1))


if __name__ == "__main__":
    main()
