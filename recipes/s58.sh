#!/usr/bin/env bash
# Session 58: the sampled ShareGPT pass (recipes/s52.sh's gen-chat-52) and the seed-53 GSM8K-train pass
# (recipes/s53.sh's gen-sampled-53) reach their last shards this session, and mt-bench and GSM8K style must not fall
# behind in the mix, so a fresh pass of each starts under --seed 58 in its own directory (every prompt in another
# seeded order, each answered anew at temperature 0.7).
# recipes/s56.sh's streams run first, from their starts, then the two new ones; the shipped drafter and its DFlash
# twin continue on the mix (recipes/continue-stage.sh), every generated directory that holds shards here at weight 2.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later stage
# reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s58.sh
#   (recipes/s56.sh's variables; for the new passes CHAT58_SECONDS, CHAT58_START, GEN58_SECONDS and GEN58_START;
#   STEPS; SKIP_DATA=1, SKIP_TRAIN=1).
#   Where runs/ was lost, or holds only a later session's shards, the *_START variables skip the shards trained on.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s58}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s56.sh
    $D train-data --out runs/data/gen-chat-58 --sharegpt 8000 --seed 58 --start-shard "${CHAT58_START:-0}" \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CHAT58_SECONDS:-360}"
    $D train-data --out runs/data/gen-sampled-58 --prompts "$P/gsm8k_train.jsonl" --seed 58 \
        --start-shard "${GEN58_START:-0}" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${GEN58_SECONDS:-360}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the mix: these generated directories at weight 2 (those with shards here), plus the greedy ShareGPT chats
SKIP_DATA=1 NAME=$NAME GEN_DIRS="gen-chat-58 gen-sampled-58 gen-code-56 gen-sampled-53 gen-chat-52 gen-sampled-48
    gen-sampled-44 gen-sampled-38b gen-code-38b gen-chat-43 gen-code-46 gen-chat-46" \
    exec bash recipes/continue-stage.sh
