#!/usr/bin/env bash
# Every row of the quality table on the name-disjoint E2E split, trained with
# one recipe (benchmarks/quality_run.sh: LoRA r=32, 300 steps of 16), then
# benchmarks/results/quality.{json,md,png} (`skipdecode bench --quality`).
# Each finished row is skipped on a rerun; a killed row resumes. Several hours
# on 2 CPU cores. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
R=benchmarks/results
Q=benchmarks/quality_run.sh
# the untrained model, for contrast
[ -f $R/eval-names-untrained.json ] || $BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv \
  --split validation-names --model default --speedups 1,2,3,4,5 --out $R/eval-names-untrained.json
# the full-depth-only reference: what fine-tuning alone reaches at 1x
[ -f $R/eval-names-full-only.json ] || $Q names-full-only "" -- --speedups 1
# SkipDecode, one checkpoint for 1x-5x (the first recipe, already in eval-e2e-names-lora32.json)
[ -f $R/eval-e2e-names-lora32.json ] || benchmarks/train_e2e_names_lora.sh
# SkipDecode with self-distillation from its own full-depth pass
[ -f $R/eval-names-distill.json ] || $Q names-distill "" -- --speedups 1,2,3,4,5 --distill 0.5
# early exit with the same monotone budgets, trained the same way
[ -f $R/eval-names-early-exit.json ] || $Q names-early-exit "--mode early_exit" -- --speedups 1,2,3,4,5 \
  --mode early_exit
# static layer drop (ShortGPT), one pruned model per speedup, fine-tuned at its own (full) depth
for x in 2 3 5; do
  [ -f $R/eval-names-drop-${x}x.json ] && continue
  [ -f runs/drop-${x}x-base/config.json ] || $BIN/skipdecode prune --model default --data e2e-names --speedup $x \
    -o runs/drop-${x}x-base
  MODEL=runs/drop-${x}x-base $Q names-drop-${x}x "--speedups 1" -- --speedups 1
done
# the capacity bound: the same recipe with full fine-tuning instead of LoRA
[ -f $R/eval-names-full-ft.json ] || benchmarks/quality_full_ft.sh
# SkipDecode with 1x drawn twice as often as each other target (the 1x gap)
[ -f $R/eval-names-weighted.json ] || $Q names-weighted "" -- --speedups 1,1,2,3,4,5
# the same, trained twice as long (600 steps of 16, about 2.5 epochs)
[ -f $R/eval-names-weighted-long.json ] || $Q names-weighted-long "" -- --speedups 1,1,2,3,4,5 --steps 600
# the 1x-drawn-twice recipe with the norms' weights trained beside LoRA (reported in the README, not a table row)
[ -f $R/eval-names-norms.json ] || $Q names-norms "" -- --speedups 1,1,2,3,4,5 --lora-norms
# the 600-step checkpoint run with front-loaded schedules (the depth on the first 3 tokens), no retraining
[ -f $R/eval-names-weighted-long-front.json ] || $BIN/skipdecode evaluate --task e2e \
  --data ../shared/data/e2e/devset.csv --split validation-names --model runs/names-weighted-long \
  --speedups 1,2,3,4,5 --horizon 3 --decay 5 --out $R/eval-names-weighted-long-front.json
# the 600-step recipe trained with front-loaded schedules
[ -f $R/eval-names-front-600.json ] || $Q names-front-600 "" -- --speedups 1,1,2,3,4,5 --steps 600 --horizon 3 --decay 5
# the shipped checkpoint: the same, trained 900 steps, into the package
[ -f $R/eval-names-default-e2e.json ] || benchmarks/ship_default_e2e.sh
# the 900-step recipe with the draws moved from 2x and 4x to 3x and 5x (1x:2x:3x:4x:5x = 3:1:2:1:2)
[ -f $R/eval-names-front-35x.json ] || $Q names-front-35x "" -- --speedups 1,1,1,2,3,3,4,5,5 --steps 900 \
  --horizon 3 --decay 5
# the front-loaded 600-step recipe with two warm-up layers instead of one (layers 0-1 always run)
[ -f $R/eval-names-front-600-w2.json ] || $Q names-front-600-w2 "" -- --speedups 1,1,2,3,4,5 --steps 600 \
  --horizon 3 --decay 5 --warmup-layers 2
$BIN/skipdecode compare $R/eval-names-front-600-w2.json $R/eval-names-front-600.json \
  --out $R/compare-names-front-600-w2-vs-front-600.json
# a candidate against the shipped checkpoint, paired on the same MRs (the gap and its 95% interval)
$BIN/skipdecode compare $R/eval-names-front-35x.json $R/eval-names-default-e2e.json \
  --out $R/compare-names-front-35x-vs-default-e2e.json
# the paper's protocol at 5x: one model for one speedup (the front-loaded 600-step recipe, 5x draws only),
# paired against the shipped checkpoint that serves 1x-5x
[ -f $R/eval-names-front-only5.json ] || $Q names-front-only5 "--speedups 5" -- --speedups 5 --steps 600 --horizon 3 --decay 5
$BIN/skipdecode compare $R/eval-names-front-only5.json $R/eval-names-default-e2e.json \
  --out $R/compare-names-front-only5-vs-default-e2e.json
# the same 5x-only model with four times the adapter (LoRA r=128, alpha 256: the same alpha/r), paired
# against r=32: does more capacity in the 5-layer path help?
[ -f $R/eval-names-front-only5-r128.json ] || $Q names-front-only5-r128 "--speedups 5" -- --speedups 5 --steps 600 \
  --horizon 3 --decay 5 --lora-r 128 --lora-alpha 256
$BIN/skipdecode compare $R/eval-names-front-only5-r128.json $R/eval-names-front-only5.json \
  --out $R/compare-names-front-only5-r128-vs-r32.json
# then, on a quiet machine: skipdecode bench --quality (every row's speed in one run; the table and plot)
