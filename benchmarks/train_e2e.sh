#!/usr/bin/env bash
# The E2E study: train the shipped `default-e2e` adapter and score it against the
# untrained default model at 1x/2x/3x/5x on the 60 held-out MRs (split by MR).
# Then renders benchmarks/results/train-e2e.{json,md} (benchmarks/report_e2e.sh). About 25 min of training and
# a few minutes of evaluation on 2 CPU cores. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DATA=../shared/data/e2e/devset.csv
RUN=runs/default-e2e
SHIP=src/skipdecode/models/default-e2e
TRAIN="skipdecode train --model default --data e2e --lora --lora-r 16 --lora-alpha 32 --speedups 1,2,3,4,5 --steps 150 --batch-size 16 --lr 1e-3 --save-every 25 -o $RUN"

[ -f "$RUN/adapter_model.safetensors" ] || $BIN/$TRAIN
mkdir -p "$SHIP"
cp "$RUN"/adapter_config.json "$RUN"/adapter_model.safetensors "$RUN"/skipdecode.json "$RUN"/train_log.jsonl "$SHIP"/

EXP=$($BIN/python -c "import json; print(json.load(open('$RUN/skipdecode.json'))['expected_new_tokens'])")
EVAL_TUNED="skipdecode evaluate --task e2e --data $DATA --split validation --model default-e2e --speedups 1,2,3,5 --out benchmarks/results/eval-e2e-default-e2e.json"
EVAL_BASE="skipdecode evaluate --task e2e --data $DATA --split validation --model default --speedups 1,2,3,5 --expected-new-tokens $EXP --out benchmarks/results/eval-e2e-default.json"
$BIN/$EVAL_TUNED
$BIN/$EVAL_BASE
bash benchmarks/report_e2e.sh
