#!/usr/bin/env bash
# Session 28: stage H continued on answers to prompts in the shape the benchmark sets (and the users
# they stand for) send: GSM8K-train questions with the math evals' instruction line, and HumanEval-shaped
# code prompts from the standard library (functions and methods, instruction line included).
# Resumable: rerun the same command after any stop (finished shards are skipped, training resumes from
# runs/train/s28/ckpt.pt). P = a folder holding gsm8k_train.jsonl (see docs/training.md).
#   P=/path/to/train-prompts bash recipes/s28-eval-style.sh
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
# 1. greedy answers of the target: 4,000 GSM8K-train questions with the instruction line, 1,672 code prompts
$D train-data --out runs/data/gen-evalstyle-28 --prompts "$P/gsm8k_train.jsonl:4000" \
    --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' --code-test-prompts 1672 \
    --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${GEN_SECONDS:-1800}"
# 2. stage H continued on them (weighted up) and on session 26's chat answers, without the human-written chats
$D train --data runs/data/gen-evalstyle-28:3 --data runs/data/gen-chat-26:2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s28 --num-layers 2 --markov-rank 64 \
    --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 \
    --anchors 128 --steps "${STEPS:-160}" --conf-label greedy --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 \
    --val-every-nth 20 --val-max 16 --curve-start 20000 --no-curve-snapshots --threads 2 --export runs/drafters/s28
# 3. DFlash on the same data and steps, from the same backbone (stage H without its two heads)
$D train --data runs/data/gen-evalstyle-28:3 --data runs/data/gen-chat-26:2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s28-dflash --num-layers 2 --markov-rank 0 \
    --no-confidence-head --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 \
    --micro-tokens 4096 --anchors 128 --steps "${STEPS:-160}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 \
    --val-every-nth 20 --val-max 16 --curve-start 20000 --no-curve-snapshots --threads 2 --export runs/drafters/s28-dflash
# 4. the benchmark (every draft verified, gamma 7) and the DSpark drafter's STS
$D bench offline --dataset bench/data/eval --num-prompts 40 --max-tokens 256 --methods dspark-fixed --block-size 7 \
    --concurrency 16 --repeats 1 --dspark-draft-model runs/drafters/s28 --out runs/bench/tau-s28
$D bench offline --dataset bench/data/eval --num-prompts 40 --max-tokens 256 --methods dflash --block-size 7 \
    --concurrency 16 --repeats 1 --dflash-draft-model runs/drafters/s28-dflash --out runs/bench/tau-s28-dflash
$D calibrate --drafter runs/drafters/s28 --data runs/data/gen-evalstyle-28 --val-every-nth 20 --max-anchors 256
