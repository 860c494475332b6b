#!/usr/bin/env bash
# int4 quantization-aware fine-tuning of default-e2e (recipes/default-e2e-int4-qat.yaml): makes its
# starting point with `skipdecode awq` (AWQ channel scales, GPTQ-rounded int4 block linears) if
# missing, trains 150 steps of 16 through int4's rounding at lr 5e-5 and at 1e-4 (about 20 min
# each on 2 CPU cores; a killed run resumes), scores both on select against the int4 they start
# from and picks one by a fixed rule (benchmarks/qat_select.py -> benchmarks/results/qat-select.json),
# then scores the chosen run once on report (benchmarks/results/qat/dtype-parity.{json,md}, held
# against default-e2e's fp32). Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
START=runs/default-e2e-gptq
RECIPE=recipes/default-e2e-int4-qat.yaml

[ -f "$START/model.safetensors" ] || $BIN/skipdecode awq -o "$START"
train() {  # RUN [overrides...]
  local run=$1; shift
  [ -f "$run/model.safetensors" ] || $BIN/skipdecode train --config $RECIPE "$@" -o "$run" \
    $([ -d "$run/checkpoints" ] && echo --resume)
}
train runs/default-e2e-int4-qat
train runs/default-e2e-int4-qat-lr1e-4 --lr 1e-4
[ "${SKIP_SELECT:-0}" = 1 ] || $BIN/python benchmarks/qat_select.py
CHOSEN=$($BIN/python -c "import json; print(json.load(open('benchmarks/results/qat-select.json'))['chosen'])")
[ "${SKIP_REPORT:-0}" = 1 ] || $BIN/skipdecode bench --dtype-parity --model "$CHOSEN" --out-dir benchmarks/results/qat
