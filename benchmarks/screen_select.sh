#!/usr/bin/env bash
# Scores GPU screen runs (runs/gpu-NAME, from benchmarks/screen_*_gpu.sh) on e2e-heldout's select
# part, where choices are made: candidates at 1x-5x; a full-depth-only reference (NAME ending in
# -ref) at 1x, and, since a reference is compared with and never chosen, also on report at 1x.
# The adapters came back from the GPU machine rounded to bf16 (the files scored here, and the
# files that would ship). Writes benchmarks/results/eval-select-screen-NAME.json,
# train-log-screen-NAME.jsonl, train-meta-screen-NAME.json (the run's skipdecode.json: its
# validation loss per target) and, for a reference, eval-report-screen-NAME.json. A result
# already written is not scored again.
# Usage, from the repository root: benchmarks/screen_select.sh NAME [NAME...]
set -euo pipefail
export HF_HUB_OFFLINE=1
[ $# -gt 0 ] || { echo "usage: $0 NAME [NAME...]  (scores runs/gpu-NAME)" >&2; exit 2; }
R=benchmarks/results DATA=../shared/data/e2e/devset.csv
for m in "$@"; do
  [ -f runs/gpu-$m/adapter_model.safetensors ] || { echo "runs/gpu-$m has no finished adapter" >&2; exit 1; }
  sp=1,2,3,4,5; case $m in *-ref) sp=1;; esac
  cp runs/gpu-$m/train_log.jsonl $R/train-log-screen-$m.jsonl
  cp runs/gpu-$m/skipdecode.json $R/train-meta-screen-$m.json
  [ -f $R/eval-select-screen-$m.json ] || .venv/bin/skipdecode evaluate --task e2e --data $DATA --split select \
    --model runs/gpu-$m --speedups $sp --out $R/eval-select-screen-$m.json
  case $m in *-ref)
    [ -f $R/eval-report-screen-$m.json ] || .venv/bin/skipdecode evaluate --task e2e --data $DATA \
      --split report --model runs/gpu-$m --speedups 1 --out $R/eval-report-screen-$m.json;;
  esac
done
