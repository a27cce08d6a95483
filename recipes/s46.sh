#!/usr/bin/env bash
# Session 46: the package-prompt (seed 38) and chat (seed 43) streams of recipes/s43.sh are finished, so two new
# passes start in their own directories: sampled answers to the package prompts under --seed 46, and sampled
# (T = 0.7) answers to ShareGPT first turns under --seed 46 (another seeded draw of the prompts, and sampled, so a
# prompt drawn again gets another answer). recipes/s44.sh's streams run first, from their starts, then the two
# new ones; the shipped drafter and its DFlash twin continue on the mix (recipes/continue-stage.sh).
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later stage
# reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s46.sh
#   (recipes/s44.sh's variables: GEN_SECONDS, SEED44_START, CODE_SECONDS, CODE_START, CHAT_SECONDS, CHAT_START;
#   for the new passes CODE46_SECONDS, CODE46_START, CHAT46_SECONDS, CHAT46_START; STEPS; SKIP_DATA=1,
#   SKIP_TRAIN=1). A stream fills every missing shard from its start: where runs/ was lost, or holds only a later
#   session's shards, the *_START variables skip the shards trained on already.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s46}
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64)
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s44.sh
    $D train-data --out runs/data/gen-code-46 --package-test-prompts 7855 --seed 46 \
        --start-shard "${CODE46_START:-0}" "${SAMPLED[@]}" --time-limit "${CODE46_SECONDS:-360}"
    $D train-data --out runs/data/gen-chat-46 --sharegpt 6000 --seed 46 \
        --start-shard "${CHAT46_START:-0}" "${SAMPLED[@]}" --time-limit "${CHAT46_SECONDS:-360}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the mix: these generated directories at weight 2 (those with shards here), plus the greedy ShareGPT chats
SKIP_DATA=1 NAME=$NAME GEN_DIRS="gen-sampled-44 gen-sampled-38b gen-code-38b gen-chat-43 gen-code-46 gen-chat-46" \
    exec bash recipes/continue-stage.sh
