#!/usr/bin/env bash
# One full-fine-tuning checkpoint per speedup, against the mixed one of
# benchmarks/train_e2e_full.sh (same lr and batch): a full-depth-only model
# (the 1x reference of the paper's comparison, also run with the skip
# schedules for contrast) and a 2x-only model, 150 steps each.
# About 25 min of training each on 2 CPU cores. Writes
# benchmarks/results/eval-e2e-full-only{1,2}x.json. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DATA=../shared/data/e2e/devset.csv
for SP in ${SPEEDUPS:-2 1}; do  # SPEEDUPS="3" adds a 3x-only run
  RUN=runs/e2e-full-only${SP}x
  [ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/e2e-full.yaml --speedups "$SP" \
    --steps 150 -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
  # the 1x-only model has no skip schedules of its own: the mixed run's (solved for its 29 tokens)
  case $SP in 1) EVAL=(--speedups 1,2,3 --expected-new-tokens 29) ;; *) EVAL=(--speedups "1,$SP") ;; esac
  $BIN/skipdecode evaluate --task e2e --data $DATA --split validation --model "$RUN" "${EVAL[@]}" \
    --out benchmarks/results/eval-e2e-full-only${SP}x.json
done
