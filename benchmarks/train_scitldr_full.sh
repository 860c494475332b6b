#!/usr/bin/env bash
# SciTLDR with the E2E recipe that kept quality (benchmarks/train_e2e_gentle.sh):
# full fine-tuning, schedules drawn per batch from {1x, 2x, 3x}, gentle solved
# schedules (--decay 1.25), lr 2e-4. Scored on the first 100 dev papers (max
# over TL;DRs) at 1x/2x/3x. About 1 h of training on 2 CPU cores. Writes
# benchmarks/results/eval-scitldr-full123-gentle.json and re-renders
# benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
RUN=runs/scitldr-full123-gentle
TRAIN="skipdecode train --model default --data scitldr --speedups 1,2,3 --decay 1.25 --steps 200 --batch-size 8 --lr 2e-4 --save-every 20 -o $RUN --no-progress"
[ -f "$RUN/model.safetensors" ] || $BIN/$TRAIN $([ -d "$RUN/checkpoints" ] && echo --resume)
EVAL="skipdecode evaluate --task scitldr --data $DEV --limit 100 --model $RUN --speedups 1,2,3 --out benchmarks/results/eval-scitldr-full123-gentle.json"
$BIN/$EVAL
bash benchmarks/report_scitldr.sh
