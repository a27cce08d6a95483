#!/usr/bin/env bash
# The measurements that decide whether a trained stage ships (dspark/checkpoints/README.md), after
# recipes/continue-stage.sh (or a recipe that runs it) exported runs/drafters/NAME and its DFlash twin NAME-dflash:
#   1. the tau benchmark of the candidate and of its twin (40 prompts a set, 256 tokens, gamma 7, every draft
#      verified: compare with the shipped stage's figures on the same cache dtype);
#   2. STS calibration of the candidate's confidence head on the held-out split of the generated directories in
#      runs/data (writes runs/drafters/NAME/sts.json; the test ECE per position and per source to calibrate.txt);
#   3. the throughput planner at batch 1 against plain decoding (10 prompts a set, 128 tokens, three repeats).
# Outputs under bench/results/tau-NAME (R=... to change). Each step is skipped when its output exists, so a
# rerun after a stop goes on where it stopped. Nothing here times anything against a background job's cores
# but step 3: run it on idle cores.
#   NAME=sNN bash recipes/evaluate-stage.sh
set -euo pipefail
: "${NAME:?set NAME to the run name of the stage (runs/drafters/NAME, runs/drafters/NAME-dflash)}"
D=${DSPARK_BIN:-.venv/bin/dspark}
R=${R:-bench/results/tau-$NAME}
DRAFTER=runs/drafters/$NAME
[[ -d "$DRAFTER" && -d "$DRAFTER-dflash" ]] || { echo "no $DRAFTER or $DRAFTER-dflash: train the stage first" >&2; exit 2; }
mkdir -p "$R"
TAU=(bench offline --dataset bench/data/eval --num-prompts 40 --max-tokens 256 --block-size 7 --concurrency 16
     --repeats 1 --no-progress)
[[ -f "$R/dspark/results.json" ]] || $D "${TAU[@]}" --methods dspark-fixed --dspark-draft-model "$DRAFTER" --out "$R/dspark"
[[ -f "$R/dflash/results.json" ]] || $D "${TAU[@]}" --methods dflash --dflash-draft-model "$DRAFTER-dflash" --out "$R/dflash"
if [[ ! -f "$R/calibrate.txt" ]]; then
    DATA=()
    for dir in runs/data/gen-*; do  # every generated directory with shards here
        compgen -G "$dir/shard_*.pt" > /dev/null && DATA+=(--data "$dir")
    done
    [[ ${#DATA[@]} -gt 0 ]] || { echo "no generated data under runs/data to calibrate on" >&2; exit 2; }
    $D calibrate --drafter "$DRAFTER" "${DATA[@]}" --val-every-nth 20 --max-anchors 256 > "$R/calibrate.txt.part"
    mv "$R/calibrate.txt.part" "$R/calibrate.txt"
fi
[[ -f "$R/c1/results.json" ]] || $D bench offline --dataset bench/data/eval --num-prompts 10 \
    --methods ar,dspark-throughput --max-tokens 128 --dspark-draft-model "$DRAFTER" --repeats 3 --no-progress \
    --out "$R/c1"
echo "done: $R"
