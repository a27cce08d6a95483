#!/usr/bin/env bash
# Session 52: the seed-46 sampled pass over ShareGPT first turns (recipes/s46.sh's gen-chat-46) ends at shard 46,
# and chat (mt-bench) is the weakest eval set, so another sampled pass over ShareGPT first turns starts under
# --seed 52 in its own directory: 8000 turns of another seeded shuffle of the dump's 13,567 distinct first turns
# that pass the filters (every --sharegpt pass draws from those), and a turn drawn again gets another sampled
# answer. recipes/s48.sh's streams run first, from their starts, then the new one; the shipped drafter and its
# DFlash twin continue on the mix (recipes/continue-stage.sh), every generated directory that holds shards here
# at weight 2.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later stage
# reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s52.sh
#   (recipes/s48.sh's variables; for the new pass CHAT52_SECONDS and CHAT52_START; STEPS; SKIP_DATA=1, SKIP_TRAIN=1).
#   Where runs/ was lost, or holds only a later session's shards, the *_START variables skip the shards trained on.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s52}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s48.sh
    $D train-data --out runs/data/gen-chat-52 --sharegpt 8000 --seed 52 --start-shard "${CHAT52_START:-0}" \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CHAT52_SECONDS:-360}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the mix: these generated directories at weight 2 (those with shards here), plus the greedy ShareGPT chats
SKIP_DATA=1 NAME=$NAME GEN_DIRS="gen-chat-52 gen-sampled-48 gen-sampled-44 gen-sampled-38b gen-code-38b
    gen-chat-43 gen-code-46 gen-chat-46" \
    exec bash recipes/continue-stage.sh
