#!/usr/bin/env bash
# Quality on unseen restaurant names: trained and scored on the name-disjoint
# E2E split (`e2e-names`: whole restaurant names held out, 73 MRs). LoRA r=32
# (about 32 MB), one checkpoint for 1x..5x with the gentle schedules
# (--decay 1.25), 300 steps of 16. About 45 min of training on 2 CPU cores,
# then the evaluation at 1x-5x. Resumes a killed run. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/e2e-names-lora32
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/names-lora32.yaml \
  --speedups 1,2,3,4,5 -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation-names --model "$RUN" \
  --speedups 1,2,3,4,5 --out benchmarks/results/eval-e2e-names-lora32.json
