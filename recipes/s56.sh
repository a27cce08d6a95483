#!/usr/bin/env bash
# Session 56: the sampled package-prompt pass of recipes/s46.sh (gen-code-46, seed 46) finished in session 55, and
# without new code the HumanEval-style answers would fall behind in the mix, so a second sampled pass over the
# package prompts starts under --seed 56 in its own directory (every prompt in another seeded order, each answered
# anew at temperature 0.7).
# recipes/s53.sh's streams run first, from their starts, then the new one; the shipped drafter and its DFlash twin
# continue on the mix (recipes/continue-stage.sh), every generated directory that holds shards here at weight 2.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later stage
# reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s56.sh
#   (recipes/s53.sh's variables; for the new pass CODE56_SECONDS and CODE56_START; STEPS; SKIP_DATA=1, SKIP_TRAIN=1).
#   Where runs/ was lost, or holds only a later session's shards, the *_START variables skip the shards trained on.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
NAME=${NAME:-s56}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s53.sh
    $D train-data --out runs/data/gen-code-56 --package-test-prompts 7855 --seed 56 \
        --start-shard "${CODE56_START:-0}" \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CODE56_SECONDS:-360}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the mix: these generated directories at weight 2 (those with shards here), plus the greedy ShareGPT chats
SKIP_DATA=1 NAME=$NAME GEN_DIRS="gen-code-56 gen-sampled-53 gen-chat-52 gen-sampled-48 gen-sampled-44
    gen-sampled-38b gen-code-38b gen-chat-43 gen-code-46 gen-chat-46" \
    exec bash recipes/continue-stage.sh
