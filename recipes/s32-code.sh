#!/usr/bin/env bash
# Next continuation (data started in session 31): the target's greedy answers to HumanEval-shaped prompts made
# from the modules of networkx, sympy, mpmath, python-dateutil, pyparsing, packaging and Jinja2
# (`--package-test-prompts`, ~7.8k; the stdlib's 1,672 are used up) and to 1,500 ShareGPT first turns no
# earlier directory answered; then the shipped drafter and its DFlash twin continue on the same batches.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
# P = a folder holding gsm8k_train.jsonl (see docs/training.md).
#   P=/path/to/train-prompts bash recipes/s32-code.sh
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
# 1. greedy answers (session 31 ran this beside its benchmarks and tests: stopped after 11 shards, then rerun
#    with GEN_SECONDS=3900)
[[ "${SKIP_DATA:-0}" == 1 ]] || $D train-data --out runs/data/gen-code-31 --package-test-prompts 7855 --sharegpt 1500 \
    --skip-answered runs/data/gen-evalstyle-30 --skip-answered runs/data/gen-chat-26 \
    --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${GEN_SECONDS:-2400}"
# 2. the shipped drafters continue, same batches. Session 32 skipped step 1 (18 of its 74 shards were done) and
#    added two directories recipes/s32-gpu.sh made on a GPU: new sampled GSM8K answers and 1,024 answers to the
#    code / chat mix (SKIP_DATA=1 leaves step 1 out)
$D train --data runs/data/gen-code-31:2 --data runs/data/gpu-math-sampled-32 --data runs/data/gpu-other-greedy-32 \
    --data runs/data/gen-sampled-31 --data runs/data/gen-evalstyle-30 \
    --data runs/data/gen-evalstyle-28 --data runs/data/gen-chat-26 --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-160}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s32 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s32 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s32-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s32-dflash'
