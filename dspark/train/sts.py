"""Sequential Temperature Scaling: verification logs, per-position temperature fit, sts.json, diagram."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))  # candidate temperatures (includes 1.0)


def ece(pred: np.ndarray, label: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins over [0, 1]."""
    if len(pred) == 0:
        return 0.0
    idx = np.minimum((pred * bins).astype(np.int64), bins - 1)
    sp = np.bincount(idx, weights=pred, minlength=bins)
    sl = np.bincount(idx, weights=label, minlength=bins)
    return float(np.abs(sp - sl).sum() / len(pred))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def prefix_probs(logits: np.ndarray, temps: np.ndarray, offset: float = 0.0) -> np.ndarray:
    """a_k = prod_{i<=k} sigmoid((z_i + offset) / T_i): logits [N, gamma] -> [N, gamma]."""
    return np.cumprod(_sigmoid((logits + offset) / temps[None, :]), axis=1)


def position_ece(logits: np.ndarray, survived: np.ndarray, valid: np.ndarray, temps, offset: float = 0.0,
                 bins: int = 15) -> list[float]:
    """ECE of the prefix-survival probability at each position (e.g. on logs the fit never saw)."""
    a = prefix_probs(logits, np.asarray(temps, dtype=np.float64), offset)
    return [round(ece(a[valid[:, k].astype(bool), k], survived[valid[:, k].astype(bool), k].astype(np.float64),
                      bins), 5) for k in range(logits.shape[1])]


OFFSETS = np.round(np.arange(-3.0, 3.0001, 0.25), 4)  # coarse shared logit offsets (includes 0), refined by 0.05


def fit_sts(logits: np.ndarray, survived: np.ndarray, valid: np.ndarray, bins: int = 15,
            grid: np.ndarray = GRID, tie: float = 5e-4, offsets: np.ndarray | None = None) -> dict[str, Any]:
    """Left-to-right 1-D grid search of T_k minimising the ECE of a_{k-1}^cal * sigmoid(z_k / T_k).

    logits [N, gamma] confidence logits; survived [N, gamma] 1 if drafts 1..k were all accepted;
    valid [N, gamma] whether position k of that block was verifiable (inside the sequence).

    offsets: candidate logit offsets b shared by all positions (z_k -> (z_k + b) / T_k). A temperature
    cannot move a biased head's probabilities across 0.5 (sigmoid(z / T) keeps the sign of z); an
    offset can. Each candidate gets its own temperature fit, and the one with the smallest worst-position
    ECE wins (near-ties: the smallest |b|). The offset is a shift of the confidence head's bias, so it
    folds into the checkpoint (see drafters/io.py) and exported drafters keep temperature-only STS.
    """
    if offsets is None:
        return _fit_temperatures(logits, survived, valid, bins, grid, tie) | {"logit_offset": 0.0}

    def search(candidates: np.ndarray) -> tuple[float, dict[str, Any]]:
        fits = [(float(b), _fit_temperatures(logits + b, survived, valid, bins, grid, tie)) for b in candidates]
        worst = np.array([max(f["ece_after"]) for _, f in fits])
        near = np.flatnonzero(worst <= worst.min() + tie)
        return fits[int(near[np.argmin(np.abs(np.asarray(candidates)[near]))])]

    coarse, _ = search(np.asarray(offsets))  # then every 0.05 within one coarse step of the winner
    step = float(np.min(np.diff(np.sort(offsets)))) if len(offsets) > 1 else 0.0
    b, best = search(np.round(np.arange(coarse - step, coarse + step + 1e-9, 0.05), 4) if step else [coarse])
    best["ece_before"] = position_ece(logits, survived, valid, np.ones(logits.shape[1]), 0.0, bins)
    return best | {"logit_offset": round(float(b), 4)}


def _fit_temperatures(logits: np.ndarray, survived: np.ndarray, valid: np.ndarray, bins: int,
                      grid: np.ndarray, tie: float) -> dict[str, Any]:
    n, gamma = logits.shape
    temps = np.ones(gamma)
    before, after = [], []
    prev_cal = np.ones(n)
    prev_raw = np.ones(n)
    for k in range(gamma):
        m = valid[:, k].astype(bool)
        z, y = logits[m, k], survived[m, k].astype(np.float64)
        raw = prev_raw[m] * _sigmoid(z)
        before.append(ece(raw, y, bins))
        errs = np.array([ece(prev_cal[m] * _sigmoid(z / t), y, bins) for t in grid])
        near = np.flatnonzero(errs <= errs.min() + tie)  # near-ties (flat ECE): stay closest to T = 1
        best = int(near[np.argmin(np.abs(np.log(grid[near])))])
        temps[k] = float(grid[best])
        after.append(float(errs[best]))
        prev_cal = prev_cal * _sigmoid(logits[:, k] / temps[k])
        prev_raw = prev_raw * _sigmoid(logits[:, k])
    return {"temperatures": [round(float(t), 5) for t in temps], "ece_before": [round(e, 5) for e in before],
            "ece_after": [round(e, 5) for e in after], "bins": bins,
            "samples": [int(valid[:, k].sum()) for k in range(gamma)],
            "survival_rate": [round(float(survived[valid[:, k].astype(bool), k].mean()), 4) if valid[:, k].any()
                              else None for k in range(gamma)]}


@torch.no_grad()
def greedy_logs(drafter, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Offline greedy verification: draft every anchored block left to right (the drafter's own picks feed
    the sequential heads), compare to the target's greedy continuation (the data) -> logits, survived,
    valid, and the index of the sequence each block came from (in the order the batches yield them).

    batches yields (ctx_features [B,S,m*d], ids [B,S], anchor_pos [B,A], anchor_valid [B,A], loss_mask [B,S]).
    """
    from dspark.drafters.blocks import block_labels

    if drafter.confidence_head is None:
        raise ValueError("this drafter has no confidence head: nothing to calibrate")
    g = drafter.config.block_size
    runner = drafter.runner()  # the inference form's heads, on the training form's hidden states
    out_z, out_s, out_v, out_q = [], [], [], []
    seen = 0
    for ctx_f, ids, anchor_pos, anchor_valid, loss_mask in batches:
        b, s = ids.shape
        seq = (seen + torch.arange(b)).repeat_interleave(anchor_pos.shape[1])
        seen += b
        pos = torch.where(anchor_valid, anchor_pos, 0)
        block_ids, _, h = drafter.block_states(ctx_f, ids, pos, anchor_valid)
        h = h.flatten(0, 1)
        base, conf_h = runner.heads(h)
        labels, valid = block_labels(ids, pos, anchor_valid, g, loss_mask)
        labels, valid = labels.flatten(0, 1), valid.flatten(0, 1)
        prev = block_ids[..., 0].flatten()
        mh = drafter.markov_head
        state = mh.init_state((len(prev),), h) if mh is not None else None
        zs, hits = [], []
        for k in range(g):
            z, conf, state = runner.step(prev, h[:, k], base[:, k], conf_h[:, k], state)
            tok = z.argmax(-1)
            prev = drafter.d2t[tok] if drafter.d2t is not None else tok
            zs.append(conf)
            hits.append(prev == labels[:, k])
        hit = torch.stack(hits, 1) & valid
        keep = valid[:, 0]
        out_z.append(torch.stack(zs, 1)[keep].float().numpy())
        out_s.append(hit.long().cumprod(1)[keep].numpy())
        out_v.append(valid[keep].numpy())
        out_q.append(seq[keep].numpy())
    return np.concatenate(out_z), np.concatenate(out_s), np.concatenate(out_v), np.concatenate(out_q)


def reliability_png(logits: np.ndarray, survived: np.ndarray, valid: np.ndarray, temps: list[float],
                    path: str | Path, bins: int = 15, offset: float = 0.0) -> None:
    """Reliability diagram of the prefix-survival probability per position, before and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gamma = logits.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, t, b, title in ((axes[0], np.ones(gamma), 0.0, "before STS"),
                            (axes[1], np.asarray(temps), offset, "after STS")):
        a = prefix_probs(logits, t, b)
        for k in range(gamma):
            m = valid[:, k].astype(bool)
            p, y = a[m, k], survived[m, k]
            idx = np.minimum((p * bins).astype(int), bins - 1)
            xs, ys = [], []
            for bi in range(bins):
                sel = idx == bi
                if sel.sum() >= 5:
                    xs.append(p[sel].mean())
                    ys.append(y[sel].mean())
            ax.plot(xs, ys, marker="o", ms=3, label=f"k={k + 1} (ECE {100 * ece(p, y, bins):.1f}%)")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_title(title)
        ax.set_xlabel("predicted prefix survival a_k")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("observed survival (drafts 1..k accepted)")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def run_from_args(args: argparse.Namespace) -> int:
    """Collect greedy verification logs on held-out sequences, fit, write sts.json + PNG, print the table."""
    from dspark.drafters import DSparkDrafter
    from dspark.train.datagen import load_dense_target
    from dspark.train.features import target_batch
    from dspark.train.trainer import data_spec, load_dir, pad_anchors, sample_anchors

    target, _, _ = load_dense_target(args.model, dtype=args.dtype, quantization=args.target_quantization)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target.embed, target.lm_head.weight).eval()
    layers = list(drafter.config.target_layer_ids)
    dirs = [args.data] if isinstance(args.data, str) else list(args.data)
    seqs, held = [], []  # every directory's own held-out split (the trainer's), one after another
    for d in dirs:
        mine = load_dir(data_spec(d)[0], args.max_shards, args.max_len)
        held += [len(seqs) + i for i in range(len(mine)) if args.val_every_nth and i % args.val_every_nth == 0]
        seqs += mine
    if not held:
        raise ValueError("no held-out sequences (check --val-every-nth)")

    def batches():
        gen = torch.Generator().manual_seed(1234)
        for j in range(0, len(held), 4):
            idx = held[j:j + 4]
            tb = target_batch(target, [seqs[i][:2] for i in idx], layers)
            pos, valid = pad_anchors([sample_anchors(seqs[i][1], args.max_anchors, gen) for i in idx])
            yield tb.hidden.to(drafter.fc.weight.dtype), tb.ids, pos, valid, tb.loss_mask

    z, surv, valid, seq = greedy_logs(drafter, batches())
    # Fit on half the held-out sequences, measure on the other half: the reported ECE is on logs the fit never saw.
    fit, test = seq % 2 == 0, seq % 2 == 1
    res = fit_sts(z[fit], surv[fit], valid[fit], bins=args.bins, offsets=OFFSETS if args.offset else None)
    res["ece_test_before"] = position_ece(z[test], surv[test], valid[test], np.ones(z.shape[1]), 0.0, args.bins)
    res["ece_test_after"] = position_ece(z[test], surv[test], valid[test], res["temperatures"],
                                         res["logit_offset"], args.bins)
    # one fit for all; how it does on each kind of prompt (the data's sources: chat, math, code ...)
    sources = np.asarray([seqs[i][2] for i in held])[seq]
    res["ece_test_by_source"] = {
        n: {"before": position_ece(z[m], surv[m], valid[m], np.ones(z.shape[1]), 0.0, args.bins),
            "after": position_ece(z[m], surv[m], valid[m], res["temperatures"], res["logit_offset"], args.bins),
            "sequences": int(len(np.unique(seq[m])))}
        for n in sorted(set(sources[test])) for m in [test & (sources == n)]}
    res["survival_rate"] = [round(float(surv[valid[:, k].astype(bool), k].mean()), 4) if valid[:, k].any() else None
                            for k in range(z.shape[1])]
    res["sampling"] = "greedy"
    res["source"] = (f"held-out split (every {args.val_every_nth}th sequence) of "
                     f"{' + '.join(Path(data_spec(d)[0]).name for d in dirs)}: fit on its even sequences, ece_test_* on its odd ones")
    out = Path(args.out) if args.out else Path(args.drafter) / "sts.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(format_table(res))
    png = Path(args.png) if args.png else out.with_name("reliability.png")
    try:
        reliability_png(z[test], surv[test], valid[test], res["temperatures"], png, args.bins, res["logit_offset"])
        print(f"wrote {out} and {png}")
    except ImportError:
        print(f"wrote {out} (matplotlib not installed: no reliability diagram)")
    return 0


def format_table(res: dict[str, Any]) -> str:
    """Per-position temperature, ECE before/after (on the fit logs, and on the test logs where measured)
    and survival rate as a text table."""
    test = "ece_test_after" in res
    head = f"{'k':>2} {'T_k':>8} {'ECE before':>11} {'ECE after':>10}"
    head += f" {'test before':>12} {'test after':>11}" if test else ""
    lines = [f"logit offset {res.get('logit_offset', 0.0):+.2f}", head + f" {'survival':>9} {'n':>7}"]
    for k, t in enumerate(res["temperatures"]):
        row = f"{k + 1:>2} {t:>8.3f} {100 * res['ece_before'][k]:>10.2f}% {100 * res['ece_after'][k]:>9.2f}%"
        if test:
            row += f" {100 * res['ece_test_before'][k]:>11.2f}% {100 * res['ece_test_after'][k]:>10.2f}%"
        lines.append(row + f" {res['survival_rate'][k] or 0:>9.3f} {res['samples'][k]:>7}")
    for name, e in res.get("ece_test_by_source", {}).items():
        lines.append(f"{name} ({e['sequences']} test sequences): ECE before "
                     + " / ".join(f"{100 * x:.2f}" for x in e["before"])
                     + " %, after " + " / ".join(f"{100 * x:.2f}" for x in e["after"]) + " %")
    return "\n".join(lines)
