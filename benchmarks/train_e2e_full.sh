#!/usr/bin/env bash
# Full fine-tuning with schedules drawn from {1x, 2x, 3x}, for comparison with
# the shipped LoRA checkpoint: one checkpoint that is its own full-depth
# reference. About 55 min of training on 2 CPU cores, then scored at
# 1x/2x/3x/5x on the same 60 held-out MRs. Writes
# benchmarks/results/eval-e2e-full123.json. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-full123
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/e2e-full.yaml -o "$RUN"
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation --model "$RUN" \
  --speedups 1,2,3,5 --out benchmarks/results/eval-e2e-full123.json
