#!/usr/bin/env bash
# One checkpoint per speedup, for comparison with the shipped mixed checkpoint:
# the same recipe as benchmarks/train_e2e.sh but trained only at 2x, scored at
# 1x and 2x on the same 60 held-out MRs. Writes
# benchmarks/results/eval-e2e-only2x.json. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-only2x
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/e2e-lora16.yaml \
  --speedups 2 -o "$RUN"
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation --model "$RUN" \
  --speedups 1,2 --out benchmarks/results/eval-e2e-only2x.json
