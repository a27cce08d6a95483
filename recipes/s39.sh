#!/usr/bin/env bash
# Session 39: stage Q continues on the next shards of the same three streams, beside a lower-learning-rate twin.
# 1. sampled answers to the GSM8K-train questions under --seed 38, from shard 14 on;
# 2. greedy answers to the seed-36 mix of ShareGPT first turns and HumanEval-shaped package prompts, from
#    shard 34 on;
# 3. sampled answers to the HumanEval-shaped package prompts under --seed 38, from shard 6 on
#    (recipes/s38.sh's data steps again: finished shards are skipped, so they continue each stream);
# 4. the shipped drafter (stage Q) continues in one process beside two twins on the same batches: its DFlash
#    twin, and the same drafter at half the peak learning rate (1.5e-4 against 3e-4: every stage restarts
#    warmup and cosine from the shipped weights, and stage Q tied stage P on gsm8k; a lower peak asks whether
#    each restart undoes part of what the last stage learned).
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s39.sh
#   (GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
NAME=s39 exec bash recipes/continue-stage.sh \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s39-lr --lr 1.5e-4 --export runs/drafters/s39-lr'
