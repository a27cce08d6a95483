#!/usr/bin/env bash
# One more stage of the shipped drafter on the three data streams of recipes/s38.sh (sampled GSM8K-train
# answers, greedy chat, sampled package-prompt answers), continued from where they stopped, beside the
# replayed mix; the shipped drafter and its DFlash twin train in one process on the same batches.
# recipes/s38.sh (its training step), s39.sh, s40.sh and s41.sh run it.
#   NAME=sNN P=/path/to/train-prompts bash recipes/continue-stage.sh [more dspark train options, e.g. --twin '...']
#   (runs/train/NAME[-dflash], runs/drafters/NAME[-dflash]; GEN_SECONDS, CHAT_SECONDS, CODE_SECONDS, STEPS;
#   SKIP_DATA=1, SKIP_TRAIN=1; DATA: the --data options of the mix, by default recipes/s38.sh's directories;
#   GEN_DIRS instead: generated directories under runs/data, each at weight 2 where it holds shards, plus the
#   greedy ShareGPT chats, the mix of recipes/s46.sh and later; INIT: the drafters to continue from, by default
#   the shipped pair, e.g. INIT=runs/drafters/s54 for a candidate that was not shipped and its -dflash twin).
#   Resumable: finished shards are skipped, training resumes from its run dir.
set -euo pipefail
: "${P:?set P to the folder of training prompt files}"
: "${NAME:?set NAME to the run name of the stage (runs/train/NAME, runs/drafters/NAME)}"
D=${DSPARK_BIN:-.venv/bin/dspark}
INIT_DSPARK=${INIT:-dspark/checkpoints/smollm2-135m-dspark}
INIT_DFLASH=${INIT:+$INIT-dflash}
INIT_DFLASH=${INIT_DFLASH:-dspark/checkpoints/smollm2-135m-dflash}
if [[ "${SKIP_DATA:-0}" != 1 ]]; then  # session 38's data commands, continued
    SKIP_TRAIN=1 bash recipes/s38.sh
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] && exit 0
if [[ -n "${GEN_DIRS:-}" ]]; then
    # a stream with no shards here (finished, and runs/ lost since) stays out: an empty --data stops the trainer
    DATA=""
    for dir in $GEN_DIRS; do
        compgen -G "runs/data/$dir/shard_*.pt" > /dev/null && DATA="$DATA --data runs/data/$dir:2"
    done
    DATA="$DATA --data runs/data/sharegpt-chats-2k"
fi
DATA=${DATA:-"--data runs/data/gen-sampled-38:2 --data runs/data/gen-sampled-31:2 --data runs/data/gen-chat-36:2
    --data runs/data/gen-code-38:2 --data runs/data/gen-code-34 --data runs/data/sharegpt-chats-2k"}
# shellcheck disable=SC2086  # DATA is a list of options (paths without spaces)
$D train $DATA \
    --target-layer-ids 1,8,15,22,28 \
    --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 --anchors 128 \
    --steps "${STEPS:-250}" --lr 3e-4 --min-lr-ratio 0.1 --ckpt-every 5 --val-every-nth 20 --val-max 16 \
    --curve-start 20000 --no-curve-snapshots --threads 2 \
    --init-from "$INIT_DSPARK" --run-dir "runs/train/$NAME" --num-layers 2 --markov-rank 64 \
    --conf-label greedy --export "runs/drafters/$NAME" \
    --twin "--init-from $INIT_DFLASH --run-dir runs/train/$NAME-dflash --markov-rank 0 --no-confidence-head --export runs/drafters/$NAME-dflash" \
    "$@"
