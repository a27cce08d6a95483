#!/usr/bin/env bash
# Next continuation (started in session 30): sampled answers of the target (T 0.7, top-p 0.8, top-k 20, as
# DeepSpec samples its training answers) to the GSM8K-train questions with the math evals' instruction line.
# Every question already has a greedy answer (gen-evalstyle-28/30); a sampled one leaves the greedy path
# after its first sampled token that is not the target's argmax, and the trainer then keeps only the block
# slots that greedy decoding would reach (train/trainer.py on_greedy_path), so it adds new contexts rather
# than new labels. Then stage J and its DFlash twin continue on the same batches in one process.
# Resumable: rerun after any stop. P = a folder holding gsm8k_train.jsonl (see docs/training.md).
#   P=/path/to/train-prompts bash recipes/s31-sampled.sh
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
# 1. sampled answers (session 30 ran this with --time-limit 2100 while it wrapped up: 16 of 59 shards, 0.48M
#    response tokens; session 31 trained on those and did not generate more)
$D train-data --out runs/data/gen-sampled-31 --prompts "$P/gsm8k_train.jsonl" \
    --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
    --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
    --time-limit "${GEN_SECONDS:-2400}"
# 2. stage J and its DFlash twin, same batches (session 31: STEPS=160, ~45 min with its other work beside it)
$D train --data runs/data/gen-sampled-31:2 --data runs/data/gen-evalstyle-30 --data runs/data/gen-evalstyle-28 \
    --data runs/data/gen-chat-26 --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 \
    --batch-size 16 --micro-tokens 4096 --anchors 128 --steps "${STEPS:-140}" --lr 3e-4 --min-lr-ratio 0.1 \
    --ckpt-every 5 --val-every-nth 20 --val-max 16 --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s31 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s31 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s31-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s31-dflash'
