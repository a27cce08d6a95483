#!/usr/bin/env bash
# Session 34, on a machine where no earlier run's data was left: new data only, then stage M continues.
# 1. sampled answers to the GSM8K-train questions from shard 16 on (recipes/s31-sampled.sh step 1 with
#    --start-shard 16: shards 0-15 are the ones stages J-M trained on, so every shard here is new);
# 2. greedy answers to the gen-code-31 recipe's prompts (HumanEval-shaped prompts from the packages' modules
#    and ShareGPT first turns) from shard 64 on. Without the earlier directories to skip (--skip-answered),
#    the prompt list is shuffled differently from session 33's, so some of these prompts were answered
#    before: replay of code and chat beside the new math;
# 3. the shipped drafter (stage M) and its DFlash twin continue on the same batches in one process.
# Session 35 ran it (the session-34 run was lost with its machine) as GEN_SECONDS=1000 CODE_SECONDS=1200
# STEPS=200: sampled shards 16-32 and code shards 64-73, the last of that list; the result shipped as stage N.
# A next run starts the sampled shards at 33 and needs new code and chat prompts.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s34-sampled.sh   (GEN_SECONDS, CODE_SECONDS, STEPS; SKIP_DATA=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    $D train-data --out runs/data/gen-sampled-31 --prompts "$P/gsm8k_train.jsonl" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --start-shard 16 --time-limit "${GEN_SECONDS:-3000}"
    $D train-data --out runs/data/gen-code-34 --package-test-prompts 7855 --sharegpt 1500 \
        --max-tokens 320 --shard-size 128 --max-num-seqs 64 --start-shard 64 --time-limit "${CODE_SECONDS:-720}"
fi
$D train --data runs/data/gen-sampled-31 --data runs/data/gen-code-34:2 --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-200}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s34 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s34 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s34-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s34-dflash'
