#!/usr/bin/env bash
# int4 quantization-aware fine-tuning of default-e2e (recipes/default-e2e-int4-qat.yaml): makes its
# starting point with `skipdecode awq` (AWQ channel scales, GPTQ-rounded int4 block linears) if
# missing, trains 150 steps of 16 through int4's rounding (about 25 min on 2 CPU cores; a killed
# run resumes), scores it on select against the int4 it started from
# (benchmarks/qat_select.py -> benchmarks/results/qat-select.json), then once on report
# (benchmarks/results/qat/dtype-parity.{json,md}, held against default-e2e's fp32).
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
START=runs/default-e2e-gptq
RUN=runs/default-e2e-int4-qat

[ -f "$START/model.safetensors" ] || $BIN/skipdecode awq -o "$START"
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/default-e2e-int4-qat.yaml -o "$RUN" \
  $([ -d "$RUN/checkpoints" ] && echo --resume)
[ "${SKIP_SELECT:-0}" = 1 ] || $BIN/python benchmarks/qat_select.py
[ "${SKIP_REPORT:-0}" = 1 ] || $BIN/skipdecode bench --dtype-parity --model "$RUN" \
  --out-dir benchmarks/results/qat
