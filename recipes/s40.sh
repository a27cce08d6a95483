#!/usr/bin/env bash
# Session 40: stage R continues on the next shards of the same three streams, beside its DFlash twin only
# (session 39's half-peak-lr twin tied the default, so the third drafter's share of each step goes to more steps).
# 1. sampled answers to the GSM8K-train questions under --seed 38, from shard 22 on;
# 2. greedy answers to the seed-36 mix of ShareGPT first turns and HumanEval-shaped package prompts, from
#    shard 44 on;
# 3. sampled answers to the HumanEval-shaped package prompts under --seed 38, from shard 14 on
#    (recipes/s38.sh's data steps again: finished shards are skipped, so they continue each stream);
# 4. the shipped drafter (stage R) and its DFlash twin continue in one process on the same batches.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s40.sh
#   (GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
NAME=s40 exec bash recipes/continue-stage.sh
