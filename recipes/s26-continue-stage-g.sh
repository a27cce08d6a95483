#!/usr/bin/env bash
# Session 26: stage G continued on target-written answers it has never seen, plus the ShareGPT chats.
# Resumable: rerun the same command after any stop (finished shards are skipped, training resumes from
# runs/train/s26/ckpt.pt). P = a folder holding gsm8k_train.jsonl and vicuna_bench_questions.jsonl
# (JSONL prompts; see docs/training.md). Needs `make train-deps` for the ShareGPT dump.
#   P=/path/to/train-prompts bash recipes/s26-continue-stage-g.sh
# As run in session 26 (2-core Zen 5): step 1 2.5 min; step 2 8 shards (1,007 answers) in ~8 min; step 3 25
# shards (3,200 answers, shards 27-51) in its 1,500 s; ~430 response tokens/s over both. A rerun of step 3
# answers further shards for another MATH_SECONDS.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
# 1. whole ShareGPT conversations as text (no generation)
$D train-data --out runs/data/sharegpt-chats-all --sharegpt-chats 20000 --max-len 2048 --shard-size 500
# 2. greedy answers of the target to the gen-chat recipe's prompts stage G never saw (shards 26-33)
$D train-data --out runs/data/gen-chat-26 --sharegpt 4000 --code-completion-prompts 335 --max-tokens 320 \
    --shard-size 128 --max-num-seqs 64 --start-shard 26 --time-limit "${CHAT_SECONDS:-900}"
# 3. and to the gen-mathcode recipe's (GSM8K-train, vicuna, stdlib code) from shard 27 on
$D train-data --out runs/data/gen-mathcode-27 --prompts "$P/gsm8k_train.jsonl" --prompts "$P/vicuna_bench_questions.jsonl" \
    --code-prompts 335 --code-completion-prompts 335 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
    --start-shard 27 --time-limit "${MATH_SECONDS:-1500}"
# 4. stage G continued on the new answers (weighted up) and the chats
$D train --data runs/data/gen-chat-26:6 --data runs/data/gen-mathcode-27:4 --data runs/data/sharegpt-chats-all \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s26 --num-layers 2 --markov-rank 64 \
    --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 \
    --anchors 128 --steps "${STEPS:-120}" --conf-label greedy --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 \
    --val-every-nth 20 --val-max 16 --curve-start 20000 --no-curve-snapshots --threads 2 --export runs/drafters/s26
