#!/usr/bin/env bash
# The shipped default-e2e's 2x on select under other schedule shapes at inference (one variable
# each: the first budget / mean --decay, the --horizon of deep first tokens): does its 2x shortfall
# (95.6% of its 1x on select with the trained shape, horizon 3 and decay 5) come from the shape?
# Writes benchmarks/results/eval-select-default-e2e-2x-hH-dD.json. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
R=benchmarks/results
for hd in "3 1" "3 1.5" "3 2.5" "8 5" "1 1" "5 5" "12 5" "16 5"; do
  set -- $hd
  [ -f $R/eval-select-default-e2e-2x-h$1-d$2.json ] || .venv/bin/skipdecode evaluate --task e2e \
    --data ../shared/data/e2e/devset.csv --split select --model default-e2e --speedups 1,2 \
    --horizon $1 --decay $2 --no-bertscore --out $R/eval-select-default-e2e-2x-h$1-d$2.json
done
