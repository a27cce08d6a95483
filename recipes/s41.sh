#!/usr/bin/env bash
# Session 41: stage S continues on the next shards of the three streams of recipes/s38.sh, plus a fresh greedy
# chat stream, beside its DFlash twin.
# 1. recipes/s38.sh's data steps again (finished shards are skipped): sampled GSM8K-train answers from shard 29,
#    the last greedy chat shards of gen-chat-36 (its 7,500-prompt list ends at shard 58), sampled package-prompt
#    answers from shard 23;
# 2. a new greedy chat stream, gen-chat-41: another seed-41 mix of ShareGPT first turns and HumanEval-shaped
#    package prompts, without the prompts gen-chat-36 and gen-code-34 already answered;
# 3. the shipped drafter (stage S) and its DFlash twin continue in one process on the same batches, with
#    gen-chat-41 added to recipes/continue-stage.sh's mix.
# Later stages continue the same streams from where they stopped under another run name (NAME=s42: runs/train/s42,
# runs/drafters/s42, from the drafter shipped by then).
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   [NAME=sNN] P=/path/to/train-prompts bash recipes/s41.sh
#   (GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, NEW_CHAT_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    SKIP_TRAIN=1 bash recipes/s38.sh
    $D train-data --out runs/data/gen-chat-41 --sharegpt 6000 --package-test-prompts 1500 --seed 41 \
        --skip-answered runs/data/gen-chat-36 --skip-answered runs/data/gen-code-34 \
        --max-tokens 320 --shard-size 128 --max-num-seqs 64 --time-limit "${NEW_CHAT_SECONDS:-600}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
SKIP_DATA=1 NAME=${NAME:-s41} exec bash recipes/continue-stage.sh --data runs/data/gen-chat-41:2
