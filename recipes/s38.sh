#!/usr/bin/env bash
# Session 38: stage P continues on resampled math answers, the next greedy chat shards and new sampled code.
# 1. sampled answers to the GSM8K-train questions again, reshuffled and resampled under --seed 38 in a new
#    directory (gen-sampled-31 used the list up in session 37);
# 2. greedy answers to the seed-36 mix of ShareGPT first turns and HumanEval-shaped package prompts, from
#    shard 25 on (the same directory: finished shards are skipped);
# 3. sampled answers (T 0.7, as step 1) to the HumanEval-shaped package prompts under --seed 38: the code
#    that the mix held least of (gen-code-34's 10 shards and a fifth of gen-chat-36);
# 4. the shipped drafter (stage P) continues in one process beside two twins on the same batches: its DFlash
#    twin, and the same drafter with CE-heavy loss weights (1.0 CE + 0.2 TV against 0.1 + 0.9: the greedy
#    benchmark scores the target's argmax, which CE trains directly), over the sampled, chat and code
#    directories (old shards replayed beside the new) and the ShareGPT chat text.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s38.sh
#   (GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64)
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    [[ -f runs/data/sharegpt-chats-2k/manifest.json ]] || \
        $D train-data --out runs/data/sharegpt-chats-2k --sharegpt-chats 2000 --max-len 1024 --shard-size 500
    $D train-data --out runs/data/gen-sampled-38 --prompts "$P/gsm8k_train.jsonl" --seed 38 \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        "${SAMPLED[@]}" --time-limit "${GEN_SECONDS:-900}"
    $D train-data --out runs/data/gen-chat-36 --sharegpt 6000 --package-test-prompts 1500 --seed 36 \
        --skip-answered runs/data/gen-code-34 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CHAT_SECONDS:-600}"
    $D train-data --out runs/data/gen-code-38 --package-test-prompts 7855 --seed 38 \
        "${SAMPLED[@]}" --time-limit "${CODE_SECONDS:-500}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
SKIP_DATA=1 NAME=s38 exec bash recipes/continue-stage.sh \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s38-ce --ce-weight 1.0 --tv-weight 0.2 --export runs/drafters/s38-ce'
