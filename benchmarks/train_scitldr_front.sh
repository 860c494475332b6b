#!/usr/bin/env bash
# SciTLDR with the shape of the shipped E2E recipe (benchmarks/ship_default_e2e.sh):
# schedules trained front-loaded (--horizon 3 --decay 5: the depth on the first
# three generated tokens, a flat floor after them), 1x drawn twice as often as
# 2x and 3x, one checkpoint for 1x/2x/3x. Full fine-tuning (lr 2e-4, 200 steps
# of 8) as in benchmarks/train_scitldr_full.sh, because LoRA keeps far less on
# SciTLDR (benchmarks/results/train-scitldr.md). Scored on the first 100 dev
# papers (max over TL;DRs) at 1x/2x/3x with the schedules it was trained on.
# About 1 h of training on 2 CPU cores; a killed run resumes.
# Writes benchmarks/results/eval-scitldr-full-front.json and re-renders
# benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
RUN=runs/scitldr-full-front
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --model default --data scitldr --speedups 1,1,2,3 \
  --horizon 3 --decay 5 --steps 200 --batch-size 8 --lr 2e-4 --save-every 20 -o "$RUN" --no-progress \
  $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task scitldr --data $DEV --limit 100 --model "$RUN" --speedups 1,2,3 \
  --out benchmarks/results/eval-scitldr-full-front.json
bash benchmarks/report_scitldr.sh
