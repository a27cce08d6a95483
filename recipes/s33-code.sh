#!/usr/bin/env bash
# Next continuation (session 33): the rest of gen-code-31 (the target's greedy answers to HumanEval-shaped
# prompts from seven packages' modules and to ShareGPT first turns; recipes/s32-code.sh step 1 started it,
# stage L trained on its first 18 shards), then the shipped drafter (stage L) and its DFlash twin continue on
# the same batches in one process, with every shard of it in the mix.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   bash recipes/s33-code.sh            (STEPS, GEN_SECONDS; SKIP_DATA=1 leaves step 1 out)
set -euo pipefail
D=${DSPARK_BIN:-.venv/bin/dspark}
# 1. greedy answers, continued (session 33: --time-limit 3600, shards 21-73 of 74 on this 2-core machine)
[[ "${SKIP_DATA:-0}" == 1 ]] || $D train-data --out runs/data/gen-code-31 --package-test-prompts 7855 --sharegpt 1500 \
    --skip-answered runs/data/gen-evalstyle-30 --skip-answered runs/data/gen-chat-26 \
    --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${GEN_SECONDS:-3600}"
# 2. stage L and its DFlash twin, same batches; gen-code-31 now weighted 1 (74 shards against stage L's 18 at 2)
$D train --data runs/data/gen-code-31 --data runs/data/gpu-math-sampled-32 --data runs/data/gpu-other-greedy-32 \
    --data runs/data/gen-sampled-31 --data runs/data/gen-evalstyle-30 \
    --data runs/data/gen-evalstyle-28 --data runs/data/gen-chat-26 --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-240}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s33 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s33 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s33-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s33-dflash'
