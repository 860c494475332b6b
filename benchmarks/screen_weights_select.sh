#!/usr/bin/env bash
# Scores the four GPU runs of benchmarks/screen_weights_gpu.sh on e2e-heldout's select part (where
# choices are made): the control and the two speedup-weighting levers at 1x-5x, the full-depth-only
# reference at 1x. Their adapters came back from the GPU machine rounded to bf16 (the files scored
# here, and the files that would ship). A reference is compared with, never chosen, so it is also
# scored on report (1x only). Writes benchmarks/results/eval-select-screen-NAME.json,
# train-log-screen-NAME.jsonl, train-meta-screen-NAME.json (the run's skipdecode.json) and
# eval-report-screen-names-aug-1800-ref.json.
# Then, with every earlier candidate (benchmarks/results/choice-on-select.json):
#   .venv/bin/python benchmarks/choose_on_select.py default-e2e-skip default-e2e-nested \
#     default-e2e-nested-removal default-e2e-names-aug-1800 screen-names-aug-1800-gpu \
#     screen-names-aug-1800-2x2 screen-names-aug-1800-2x2-5x2
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
R=benchmarks/results DATA=../shared/data/e2e/devset.csv
for m in names-aug-1800-gpu names-aug-1800-2x2 names-aug-1800-2x2-5x2 names-aug-1800-ref; do
  sp=1,2,3,4,5; case $m in *-ref) sp=1;; esac
  cp runs/gpu-$m/train_log.jsonl $R/train-log-screen-$m.jsonl
  cp runs/gpu-$m/skipdecode.json $R/train-meta-screen-$m.json  # its validation loss on select per target
  [ -f $R/eval-select-screen-$m.json ] || .venv/bin/skipdecode evaluate --task e2e --data $DATA --split select \
    --model runs/gpu-$m --speedups $sp --out $R/eval-select-screen-$m.json
done
[ -f $R/eval-report-screen-names-aug-1800-ref.json ] || .venv/bin/skipdecode evaluate --task e2e \
  --data $DATA --split report --model runs/gpu-names-aug-1800-ref --speedups 1 \
  --out $R/eval-report-screen-names-aug-1800-ref.json
