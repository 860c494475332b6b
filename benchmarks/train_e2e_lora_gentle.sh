#!/usr/bin/env bash
# A candidate for the shipped adapter: LoRA r=16 (16 MB), one checkpoint for
# 1x/2x/3x with the gentle schedules (--decay 1.25) of
# benchmarks/train_e2e_gentle.sh, 300 steps of 16. Scored at 1x/2x/3x/5x on
# the 60 held-out MRs; writes benchmarks/results/eval-e2e-lora-gentle.json.
# About 40 min of training on 2 CPU cores. Resumes a killed run. Run from the
# repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-lora-gentle
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/e2e-lora16.yaml \
  --speedups 1,2,3 --decay 1.25 --steps 300 -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation --model "$RUN" \
  --speedups 1,2,3,5 --out benchmarks/results/eval-e2e-lora-gentle.json
bash benchmarks/report_e2e.sh
