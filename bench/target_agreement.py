"""How often the trainer's dense target pass picks the same greedy token as the served target (the
engine's decoder with its default weights: the embedded model's 4-bit layers), teacher-forced over
held-out training sequences; the dense pass on the served weights (--target-quantization served), on plain
ones (none) or on the trainer's default (auto: plain on CPUs with AMX tiles, served elsewhere).

    .venv/bin/python bench/target_agreement.py --data runs/data/gen-greedy --sequences 24 [--target-quantization none]
"""
from __future__ import annotations

import argparse
import json

import torch

from dspark.train.config import add_target_quantization_arg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a train-data directory")
    p.add_argument("--model", default=None, help="target model dir (default: the embedded SmolLM2)")
    p.add_argument("--sequences", type=int, default=24, help="every 20th sequence (the held-out split), up to N")
    add_target_quantization_arg(p)
    args = p.parse_args()
    from dspark.models.embedded import resolve_model_path
    from dspark.models.loader import load_decoder, resolve_dtype
    from dspark.train.datagen import load_dense_target, load_sequences

    dense, _, info = load_dense_target(args.model, quantization=args.target_quantization)
    served = load_decoder(resolve_model_path(args.model), dtype=resolve_dtype("auto"), pack=True, quantization="auto")
    seqs = [ids for ids, _, _ in load_sequences(args.data)[::20][:args.sequences]]
    rate = dense.agreement(served, seqs)
    print(json.dumps({"sequences": len(seqs), "positions": sum(len(s) for s in seqs), "argmax_agreement": round(rate, 5),
                      "dense": f"{info['target_dtype']}/{info['target_quantization']}", "served": served.weight_format}))


if __name__ == "__main__":
    with torch.no_grad():
        main()
