#!/usr/bin/env bash
# Scores the GPU runs of benchmarks/screen_seeds_gpu.sh (the shipped recipe at seeds 1-3) on
# e2e-heldout's select part (where choices are made) at 1x-5x. Their adapters came back from the
# GPU machine rounded to bf16 (the files scored here, and the files that would ship). Writes
# benchmarks/results/eval-select-screen-NAME.json, train-log-screen-NAME.jsonl and
# train-meta-screen-NAME.json (the run's skipdecode.json: its validation loss per target).
# Then, with every earlier candidate (benchmarks/results/choice-on-select.json):
#   .venv/bin/python benchmarks/choose_on_select.py default-e2e-skip default-e2e-nested \
#     default-e2e-nested-removal default-e2e-names-aug-1800 screen-names-aug-1800-gpu \
#     screen-names-aug-1800-2x2 screen-names-aug-1800-2x2-5x2 screen-names-aug-1800-seed1 \
#     screen-names-aug-1800-seed2 screen-names-aug-1800-seed3
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
R=benchmarks/results DATA=../shared/data/e2e/devset.csv
for m in names-aug-1800-seed1 names-aug-1800-seed2 names-aug-1800-seed3; do
  cp runs/gpu-$m/train_log.jsonl $R/train-log-screen-$m.jsonl
  cp runs/gpu-$m/skipdecode.json $R/train-meta-screen-$m.json
  [ -f $R/eval-select-screen-$m.json ] || .venv/bin/skipdecode evaluate --task e2e --data $DATA --split select \
    --model runs/gpu-$m --speedups 1,2,3,4,5 --out $R/eval-select-screen-$m.json
done
