#!/usr/bin/env bash
# Session 40: stage R continues on the next shards of the same three streams, beside its DFlash twin only
# (session 39's half-peak-lr twin tied the default, so the third drafter's share of each step goes to more steps).
# 1. sampled answers to the GSM8K-train questions under --seed 38, from shard 22 on;
# 2. greedy answers to the seed-36 mix of ShareGPT first turns and HumanEval-shaped package prompts, from
#    shard 44 on;
# 3. sampled answers to the HumanEval-shaped package prompts under --seed 38, from shard 14 on
#    (recipes/s38.sh's data steps again: finished shards are skipped, so they continue each stream);
# 4. the shipped drafter (stage R) and its DFlash twin continue in one process on the same batches.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s40.sh
#   (GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then  # steps 1-3 are session 38's data commands, continued
    SKIP_TRAIN=1 bash recipes/s38.sh
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
$D train --data runs/data/gen-sampled-38:2 --data runs/data/gen-sampled-31:2 --data runs/data/gen-chat-36:2 \
    --data runs/data/gen-code-38:2 --data runs/data/gen-code-34 --data runs/data/sharegpt-chats-2k \
    --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-250}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s40 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s40 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s40-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s40-dflash'
