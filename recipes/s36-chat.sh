#!/usr/bin/env bash
# Session 36: stage N continues on new sampled math, new greedy chat answers and replayed chat text.
# 1. 2,000 whole ShareGPT conversations as text (loss on every assistant turn, labelled with the target's
#    own greedy tokens): the chat replay stage N's mix lacked (its mt-bench tau fell by 0.02);
# 2. sampled answers to the GSM8K-train questions from shard 33 on (s34-sampled.sh's step 1: shards 16-32
#    are the ones stage N trained on, so every new shard is new);
# 3. greedy answers to a new seed's mix of ShareGPT first turns and HumanEval-shaped package prompts,
#    leaving out every prompt gen-code-34 answered (earlier sessions' directories are gone, so some of
#    these were answered before stage N: replay);
# 4. the shipped drafter (stage N) and its DFlash twin continue on the same batches in one process.
# Session 36 ran it as GEN_SECONDS=1100 CHAT_SECONDS=1000 STEPS=250 (2-core Zen 4): 1,787 chats (1.03M
# assistant tokens), sampled shards 33-50 (549k tokens, 485 tokens/s), gen-chat-36 shards 0-14 (459k tokens,
# 430 tokens/s). A next run starts the sampled shards at 51 and gen-chat-36 at 15.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
#   P=/path/to/train-prompts bash recipes/s36-chat.sh   (GEN_SECONDS, CHAT_SECONDS, STEPS; SKIP_DATA=1)
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK_BIN:-.venv/bin/dspark}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then
    [[ -f runs/data/sharegpt-chats-2k/manifest.json ]] || \
        $D train-data --out runs/data/sharegpt-chats-2k --sharegpt-chats 2000 --max-len 1024 --shard-size 500
    $D train-data --out runs/data/gen-sampled-31 --prompts "$P/gsm8k_train.jsonl" \
        --prompt-suffix 'Please reason step by step, and put your final answer within \boxed{}.' \
        --temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --start-shard 33 --time-limit "${GEN_SECONDS:-1200}"
    $D train-data --out runs/data/gen-chat-36 --sharegpt 6000 --package-test-prompts 1500 --seed 36 \
        --skip-answered runs/data/gen-code-34 --max-tokens 320 --shard-size 128 --max-num-seqs 64 \
        --time-limit "${CHAT_SECONDS:-1200}"
fi
$D train --data runs/data/gen-sampled-31:2 --data runs/data/gen-chat-36:2 --data runs/data/gen-code-34 \
    --data runs/data/sharegpt-chats-2k --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-250}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir runs/train/s36 --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export runs/drafters/s36 \
    --twin '--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir runs/train/s36-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/s36-dflash'
