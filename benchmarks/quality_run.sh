#!/usr/bin/env bash
# One row of the first name-disjoint quality table (benchmarks/results/quality-names.*): train a LoRA r=32
# adapter on the name-disjoint E2E split with the shared recipe (300 steps of
# 16, lr 1e-3, gentle schedules) plus this row's own flags, then score it on
# the held-out names at 1x-5x. Resumes a killed run.
#   [MODEL=dir] benchmarks/quality_run.sh NAME EVAL_FLAGS -- TRAIN_FLAGS...
# e.g. benchmarks/quality_run.sh names-full-only "" -- --speedups 1
# Run from the repository root; about 30 min of training on 2 CPU cores.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
NAME=$1; EVAL_FLAGS=$2; shift 2; [ "${1:-}" = "--" ] && shift
RUN=runs/$NAME
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/names-lora32.yaml \
  --model "${MODEL:-default}" -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume) "$@"
cp "$RUN/train_log.jsonl" "benchmarks/results/train-log-$NAME.jsonl" 2>/dev/null || true
# the run's record: schedules, settings, validation loss per schedule, training seconds
cp "$RUN/skipdecode.json" "benchmarks/results/train-record-$NAME.json" 2>/dev/null || true
# shellcheck disable=SC2086
$BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split validation-names --model "$RUN" \
  --speedups 1,2,3,4,5 $EVAL_FLAGS --out "benchmarks/results/eval-$NAME.json"
