#!/usr/bin/env bash
# One full-fine-tuning checkpoint per speedup on SciTLDR, with the recipe of
# benchmarks/train_scitldr_full.sh (lr 2e-4, --decay 1.25, 200 steps of 8):
# a full-depth-only model (the 1x reference of the paper's comparison, also
# run with the 2x schedule for contrast) and a 2x-only model. About 50 min of
# training each on 2 CPU cores. Writes
# benchmarks/results/eval-scitldr-full-only{1,2}x.json and re-renders the
# report. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
for SP in ${SPEEDUPS:-1 2}; do
  RUN=runs/scitldr-full-only${SP}x
  [ -f "$RUN/model.safetensors" ] || $BIN/skipdecode train --config recipes/scitldr-full.yaml --speedups "$SP" \
    --decay 1.25 -o "$RUN" \
    $([ -d "$RUN/checkpoints" ] && echo --resume)
  $BIN/skipdecode evaluate --task scitldr --data $DEV --limit 100 --model "$RUN" --speedups "1,2" \
    --out "benchmarks/results/eval-scitldr-full-only${SP}x.json"
done
bash benchmarks/report_scitldr.sh
