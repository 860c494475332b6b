#!/usr/bin/env bash
# The adapter shipped as `default-e2e` before the gentle-schedule recipe of
# benchmarks/train_e2e.sh: LoRA r=16, schedules drawn per batch from 1x-5x
# with the default (steeper) decay, 150 steps of 16. Scored at 1x/2x/3x/5x on
# the 60 held-out MRs; writes benchmarks/results/eval-e2e-lora-1to5.json.
# About 20 min of training on 2 CPU cores. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-lora-1to5
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --model default --data e2e --lora --lora-r 16 \
  --lora-alpha 32 --speedups 1,2,3,4,5 --steps 150 --batch-size 16 --lr 1e-3 --save-every 25 -o "$RUN" \
  --no-progress $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation --model "$RUN" \
  --speedups 1,2,3,5 --out benchmarks/results/eval-e2e-lora-1to5.json
bash benchmarks/report_e2e.sh
