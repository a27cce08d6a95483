"""Does the drafter lose anything to the served target's features? Its held-out greedy tau and
per-position acceptance (the trainer's validation) with the context features from the trainer's dense
bf16 target pass, as trained, and again from the served decoder (the embedded model's 4-bit kernels),
over the same held-out sequences and labels.

    .venv/bin/python bench/served_features.py --drafter dspark/checkpoints/smollm2-135m-dspark \\
        --data runs/data/gen-mathcode-27 --sequences 32
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a DSpark / DFlash drafter directory")
    p.add_argument("--data", required=True, help="a train-data directory (its every 20th sequence is held out)")
    p.add_argument("--sequences", type=int, default=32, help="held-out sequences to use")
    args = p.parse_args()
    from dspark.models.embedded import resolve_model_path
    from dspark.models.loader import load_decoder, resolve_dtype
    from dspark.train.config import TrainConfig
    from dspark.train.dense_target import served_pass
    from dspark.train.trainer import Trainer

    c = json.loads((Path(args.drafter) / "config.json").read_text())
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(TrainConfig(
            data=[args.data], run_dir=run_dir, init_from=args.drafter, num_layers=c["num_layers"],
            markov_rank=c["markov_rank"], confidence_head=c["confidence_head"], mask_token_id=c["mask_token_id"],
            target_layer_ids=list(c["target_layer_ids"]), draft_vocab_size=c["draft_vocab_size"],
            block_size=c["block_size"], anchors=128, val_every_nth=20, val_max=args.sequences, steps=1))
    dense = tr.validate()
    served = load_decoder(resolve_model_path(None), dtype=resolve_dtype("auto"), pack=True, quantization="auto")
    layers, dense_pass = tuple(tr.dcfg.target_layer_ids), tr.target.forward_packed

    def with_served_features(seqs, hidden_layers=()):
        hidden, final = dense_pass(seqs, hidden_layers=hidden_layers)  # labels stay the dense pass's
        served_hidden = [served_pass(served, s, logits=False, hidden_layers=layers).hidden for s in seqs]
        return torch.cat(served_hidden).to(hidden.dtype), final

    tr.target.forward_packed = with_served_features
    swapped = tr.validate()
    for name, v in (("dense bf16 features", dense), ("served features", swapped)):
        print(json.dumps({"features": name, "greedy_tau": round(v["greedy_tau"], 4),
                          "acceptance": [round(a, 3) for a in v["greedy_accept"]]}))


if __name__ == "__main__":
    with torch.no_grad():
        main()
