#!/usr/bin/env bash
# The capacity row of the quality table: SkipDecode (1x-5x, gentle schedules)
# with full fine-tuning instead of LoRA, on the name-disjoint E2E split, 300
# steps of 16 at lr 2e-4 (the full-tuning rate of benchmarks/train_e2e_full.sh),
# then scored on the held-out names at 1x-5x. It bounds what LoRA r=32 leaves on
# the table; at 540 MB it is not a shippable checkpoint. About 1 h of training on
# 2 CPU cores; resumes a killed run. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/names-full-ft
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/names-full.yaml -o "$RUN" \
  $([ -d "$RUN/checkpoints" ] && echo --resume)
cp "$RUN/train_log.jsonl" benchmarks/results/train-log-names-full-ft.jsonl
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation-names --model "$RUN" \
  --speedups 1,2,3,4,5 --out benchmarks/results/eval-names-full-ft.json
