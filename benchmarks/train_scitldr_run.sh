#!/usr/bin/env bash
# One SciTLDR row with its own schedule flags: full fine-tuning with the recipe
# of benchmarks/train_scitldr_full.sh (lr 2e-4, 200 steps of 8; LoRA keeps far
# less on SciTLDR, benchmarks/results/train-scitldr.md), schedules drawn per
# batch from SPEEDUPS, then scored on the first 100 dev papers (max over
# TL;DRs) at each trained speedup with the schedules it was trained on.
#   benchmarks/train_scitldr_run.sh NAME SPEEDUPS -- TRAIN_FLAGS...
# Rows run so far:
#   benchmarks/train_scitldr_run.sh full-front 1,1,2,3 -- --horizon 3 --decay 5   # the shipped E2E schedules
#   benchmarks/train_scitldr_run.sh full-flat 1,2,3 -- --decay 1                   # a flat budget per token
# About 40 min of training on 2 CPU cores; a killed run resumes. Writes
# benchmarks/results/eval-scitldr-NAME.json and re-renders
# benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
NAME=$1; SPEEDUPS=$2; shift 2; [ "${1:-}" = "--" ] && shift
RUN=runs/scitldr-$NAME
[ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/scitldr-full.yaml --speedups "$SPEEDUPS" \
  -o "$RUN" \
  $([ -d "$RUN/checkpoints" ] && echo --resume) "$@"
$BIN/skipdecode evaluate --task scitldr --data $DEV --limit 100 --model "$RUN" \
  --speedups "$(tr , '\n' <<<"$SPEEDUPS" | sort -un | paste -sd,)" --out "benchmarks/results/eval-scitldr-$NAME.json"
bash benchmarks/report_scitldr.sh
