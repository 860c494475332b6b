#!/usr/bin/env bash
# The by-MR E2E study's LoRA row: one r=16 adapter for 1x-5x, 150 steps (the
# checkpoint shipped as `default-e2e` before it was retrained on the
# name-disjoint split by benchmarks/ship_default_e2e.sh), scored against the
# untrained default model at 1x/2x/3x/5x on the 60 held-out MRs (split by MR).
# Then renders benchmarks/results/train-e2e.{json,md} (benchmarks/report_e2e.sh). About 20 min of training and
# a few minutes of evaluation on 2 CPU cores. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DATA=../shared/data/e2e/devset.csv
RUN=runs/e2e-lora16-1to5
TRAIN="skipdecode train --config recipes/e2e-lora16.yaml -o $RUN"

[ -f "$RUN/adapter_model.safetensors" ] || $BIN/$TRAIN

EXP=$($BIN/python -c "import json; print(json.load(open('$RUN/skipdecode.json'))['expected_new_tokens'])")
EVAL_TUNED="skipdecode evaluate --task e2e --data $DATA --split validation --model $RUN --speedups 1,2,3,5 --out benchmarks/results/eval-e2e-lora16-1to5.json"
EVAL_BASE="skipdecode evaluate --task e2e --data $DATA --split validation --model default --speedups 1,2,3,5 --expected-new-tokens $EXP --out benchmarks/results/eval-e2e-default.json"
$BIN/$EVAL_TUNED
$BIN/$EVAL_BASE
bash benchmarks/report_e2e.sh
