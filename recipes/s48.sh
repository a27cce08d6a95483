#!/usr/bin/env bash
# Session 48: the seed-44 sampled pass over the GSM8K-train questions (recipes/s44.sh) ends at shard 58, so a
# third sampled pass starts under --seed 48 (other answers at T = 0.7) in its own directory. recipes/s46.sh's
# streams run first, from their starts, then the new one; the shipped drafter and its DFlash twin continue on the
# mix (recipes/continue-stage.sh), every generated directory that holds shards here at weight 2.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later stage
# reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s48.sh
#   (recipes/s46.sh's variables; for the new pass GEN48_SECONDS and GEN48_START; STEPS; SKIP_DATA=1, SKIP_TRAIN=1).
#   Where runs/ was lost, or holds only a later session's shards, the *_START variables skip the shards trained on.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s48}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s46.sh
    $D train-data --out runs/data/gen-sampled-48 --prompts "$P/gsm8k_train.jsonl" --seed 48 \
        --start-shard "${GEN48_START:-0}" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${GEN48_SECONDS:-540}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the mix: these generated directories at weight 2 (those with shards here), plus the greedy ShareGPT chats
SKIP_DATA=1 NAME=$NAME GEN_DIRS="gen-sampled-48 gen-sampled-44 gen-sampled-38b gen-code-38b gen-chat-43
    gen-code-46 gen-chat-46" \
    exec bash recipes/continue-stage.sh
