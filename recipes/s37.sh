#!/usr/bin/env bash
# Session 37: stage O continues on the next sampled math and greedy chat shards, chat text replayed.
# 1. sampled answers to the GSM8K-train questions from shard 51 on (s36-chat.sh made shards 33-50);
# 2. greedy answers to the seed-36 mix of ShareGPT first turns and HumanEval-shaped package prompts, from
#    shard 15 on (the same directory: s36-chat.sh made shards 0-14, and finished shards are skipped);
# 3. the shipped drafter (stage O) and its DFlash twin continue on the same batches in one process, over
#    both directories (old shards replayed beside the new), gen-code-34 and the ShareGPT chat text.
# Session 37 ran it as GEN_SECONDS=900 CHAT_SECONDS=700 (SKIP_TRAIN=1), then SKIP_DATA=1 STEPS=290 (2-core
# Zen 4): sampled shards 51-58 (945 answers, 227k tokens; shard 58 is the list's last, so the GSM8K-train
# questions are used up: a next run samples them again under another --seed, in a new directory) and
# gen-chat-36 shards 15-24 (1,280 answers, 310k tokens). A next run continues gen-chat-36 at shard 25.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s37.sh   (GEN_SECONDS, CHAT_SECONDS, STEPS; SKIP_DATA=1, SKIP_TRAIN=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    [[ -f runs/data/sharegpt-chats-2k/manifest.json ]] || \
        $D train-data --out runs/data/sharegpt-chats-2k --sharegpt-chats 2000 --max-len 1024 --shard-size 500
    $D train-data --out runs/data/gen-sampled-31 --prompts "$P/gsm8k_train.jsonl" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --start-shard 51 --time-limit "${GEN_SECONDS:-900}"
    $D train-data --out runs/data/gen-chat-36 --sharegpt 6000 --package-test-prompts 1500 --seed 36 \
        --skip-answered runs/data/gen-code-34 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CHAT_SECONDS:-700}"
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
$D train --data runs/data/gen-sampled-31:2 --data runs/data/gen-chat-36:2 --data runs/data/gen-code-34 \
    --data runs/data/sharegpt-chats-2k --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-250}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s37 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s37 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s37-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s37-dflash'
