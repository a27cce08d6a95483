#!/usr/bin/env bash
# Session 43: stage U continues on a machine whose runs/ was lost (the data of recipes/s38.sh and s41.sh with it),
# so no old shard is replayed: only new ones, beside the ShareGPT chat text.
# 1. recipes/s38.sh's sampled streams continue where stage U stopped, in fresh directories (--start-shard):
#    GSM8K-train answers (seed 38) from shard 39, package-prompt answers (seed 38) from shard 30;
# 2. a greedy chat stream of ShareGPT first turns under --seed 43 (gen-chat-36/41, whose answered prompts it
#    would skip, are gone; greedy answers to a prompt seen before repeat it, so no package prompts here);
# 3. the shipped drafter (stage U) and its DFlash twin continue in one process on the same batches
#    (recipes/continue-stage.sh on this mix).
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir). A later stage
# reruns it under another NAME from the drafter shipped by then; where runs/ was lost again, the *_START
# variables skip the shards trained on already (session 43 stopped before shards 56, 40 and 16).
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s43.sh
#   (GEN_SECONDS, CODE_SECONDS, CHAT_SECONDS, GEN_START, CODE_START, CHAT_START, STEPS; SKIP_DATA=1, SKIP_TRAIN=1;
#   GEN_SEED and GEN_DIR: another sampled pass over the GSM8K-train questions, as recipes/s44.sh makes)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s43}
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64)
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    [[ -f runs/data/sharegpt-chats-2k/manifest.json ]] || \
        $D train-data --out runs/data/sharegpt-chats-2k --sharegpt-chats 2000 --max-len 1024 --shard-size 500
    $D train-data --out "${GEN_DIR:-runs/data/gen-sampled-38b}" --prompts "$P/gsm8k_train.jsonl" --seed "${GEN_SEED:-38}" \
        --start-shard "${GEN_START:-39}" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        "${SAMPLED[@]}" --time-limit "${GEN_SECONDS:-720}"
    $D train-data --out runs/data/gen-code-38b --package-test-prompts 7855 --seed 38 --start-shard "${CODE_START:-30}" \
        "${SAMPLED[@]}" --time-limit "${CODE_SECONDS:-480}"
    $D train-data --out runs/data/gen-chat-43 --sharegpt 6000 --seed 43 --start-shard "${CHAT_START:-0}" \
        --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${CHAT_SECONDS:-600}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
SKIP_DATA=1 NAME=$NAME DATA="--data runs/data/gen-sampled-38b:2 --data runs/data/gen-code-38b:2
    --data runs/data/gen-chat-43:2 --data runs/data/sharegpt-chats-2k" exec bash recipes/continue-stage.sh
