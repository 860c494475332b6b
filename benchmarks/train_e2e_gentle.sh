#!/usr/bin/env bash
# The recipe of benchmarks/train_e2e_full.sh with gentler solved schedules
# (--decay 1.25: first budget 1.25x the mean instead of 1.5x). At 2x this
# trains and serves 19 -> 11 layers instead of 24 -> 5; 3x stays 12 -> 8.
# About 45 min of training on 2 CPU cores, then scored at 1x/2x/3x. Writes
# benchmarks/results/eval-e2e-full123-gentle.json. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-full123-gentle
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/e2e-full.yaml --decay 1.25 \
  -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation --model "$RUN" \
  --speedups 1,2,3 --out benchmarks/results/eval-e2e-full123-gentle.json
