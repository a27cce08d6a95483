#!/usr/bin/env bash
# Session 44: recipes/s43.sh's sampled GSM8K-train stream (seed 38) answered every question, so a second
# sampled pass over them starts under --seed 44 (other answers at T = 0.7) in its own directory; the
# package-prompt and chat streams of recipes/s43.sh continue where they stopped; the shipped drafter and its
# DFlash twin continue on the mix (recipes/continue-stage.sh), the new stream beside the old ones.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir); a later
# stage reruns it under another NAME from the drafter shipped by then.
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s44.sh
#   (GEN_SECONDS and SEED44_START for the new stream, CODE_SECONDS, CHAT_SECONDS, CODE_START and CHAT_START as
#   in recipes/s43.sh, STEPS; SKIP_DATA=1, SKIP_TRAIN=1). Finished shards are skipped, but a stream fills every
#   missing shard from its start: where runs/ was lost, or holds only a later session's shards, the *_START
#   variables skip the shards trained on already. Where runs/ was lost the mix also leaves out the finished
#   seed-38 stream (nothing makes it again).
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
NAME=${NAME:-s44}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    # recipes/s43.sh's data step with its GSM8K stream moved to the seed-44 pass (the seed-38 one is finished)
    GEN_SEED=44 GEN_DIR=runs/data/gen-sampled-44 GEN_START="${SEED44_START:-0}" GEN_SECONDS="${GEN_SECONDS:-600}" \
        SKIP_TRAIN=1 bash recipes/s43.sh
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# the finished seed-38 stream is replayed where runs/ still holds it (a lost runs/ does not make it again)
OLD=""
compgen -G "runs/data/gen-sampled-38b/shard_*.pt" > /dev/null && OLD="--data runs/data/gen-sampled-38b:2"
SKIP_DATA=1 NAME=$NAME DATA="--data runs/data/gen-sampled-44:2 $OLD
    --data runs/data/gen-code-38b:2 --data runs/data/gen-chat-43:2 --data runs/data/sharegpt-chats-2k" \
    exec bash recipes/continue-stage.sh
