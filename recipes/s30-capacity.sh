#!/usr/bin/env bash
# Session 30: new eval-shaped answers (the GSM8K-train questions session 28 did not reach, with the math
# evals' instruction line, and ShareGPT first turns not answered before), then four continuations on
# the same batches (same data, seed and steps): stage I as it is (2 layers, Markov rank 64), stage I grown
# to 4 layers (the new layers start as identities), stage I with its Markov head widened to rank 256 (the
# new columns start at zero), and the shipped DFlash twin.
# Resumable: rerun the same command after any stop (finished shards are skipped, each training resumes
# from its run dir's ckpt.pt). P = a folder holding gsm8k_train.jsonl (see docs/training.md).
#   P=/path/to/train-prompts bash recipes/s30-capacity.sh
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
STEPS=${STEPS:-140}
# 1. greedy answers of the target to prompts no earlier directory answered
$D train-data --out runs/data/gen-evalstyle-30 --prompts "$P/gsm8k_train.jsonl" \
    --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' --code-test-prompts 1672 \
    --sharegpt 1500 --skip-answered runs/data/gen-evalstyle-28 --skip-answered runs/data/gen-chat-26 \
    --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${GEN_SECONDS:-2400}"
COMMON=(--data runs/data/gen-evalstyle-30:3 --data runs/data/gen-evalstyle-28 --data runs/data/gen-chat-26
        --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16
        --micro-tokens 4096 --anchors 128 --steps "$STEPS" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5
        --val-every-nth 20 --val-max 16 --curve-start 20000 --no-curve-snapshots --threads 2)
# 2. four drafters on the same batches in one process (--twin: one target pass a step for all four):
#    stage I continued (2 layers, rank 64), stage I grown to 4 layers, stage I with a rank-256 Markov head,
#    and the DFlash twin continued. (Session 30 started them as four processes with --threads 1 each,
#    killed them at steps 10-18 and resumed them from their checkpoints with this command.)
$D train "${COMMON[@]}" --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s30-2l \
    --num-layers 2 --markov-rank 64 --conf-label greedy --export runs/drafters/s30-2l \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s30-4l --num-layers 4 --export runs/drafters/s30-4l' \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s30-r256 --markov-rank 256 --export runs/drafters/s30-r256' \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s30-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s30-dflash'
# 3. the benchmark (every draft verified, gamma 7)
for m in s30-2l s30-4l s30-r256; do
  $D bench offline --dataset bench/data/eval --num-prompts 40 --max-tokens 256 --methods dspark-fixed --block-size 7 \
      --concurrency 16 --repeats 1 --dspark-draft-model runs/drafters/$m --out runs/bench/tau-$m
done
$D bench offline --dataset bench/data/eval --num-prompts 40 --max-tokens 256 --methods dflash --block-size 7 \
    --concurrency 16 --repeats 1 --dflash-draft-model runs/drafters/s30-dflash --out runs/bench/tau-s30-dflash
