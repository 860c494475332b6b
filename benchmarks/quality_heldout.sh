#!/usr/bin/env bash
# Every row of the held-out quality table (benchmarks/results/quality.{json,md,png}):
# each model trained on e2e-heldout's train part, scored on its select part
# (where choices are made) and on its report part (never chosen on), then
# `skipdecode bench --quality` times every row in one run. A finished row is
# skipped on a rerun; a killed training resumes. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
R=benchmarks/results
DATA=../shared/data/e2e/devset.csv
ev() {  # ev STEM MODEL [evaluate flags...]: score MODEL on select and report
  local stem=$1 model=$2; shift 2
  for split in select report; do
    [ -f $R/eval-$split-$stem.json ] || $BIN/skipdecode evaluate --task e2e --data $DATA --split $split \
      --model "$model" --out $R/eval-$split-$stem.json "$@"
  done
}
scored() {  # scored STEM: both splits of STEM are already scored (its model is not needed again)
  [ -f $R/eval-select-$1.json ] && [ -f $R/eval-report-$1.json ]
}
train() {  # train RUN RECIPE [flags...]: train (or resume) unless finished
  local run=$1 recipe=$2; shift 2
  [ -f runs/$run/adapter_model.safetensors ] || [ -f runs/$run/model.safetensors ] || \
    $BIN/skipdecode train --config "$recipe" -o runs/$run $([ -d runs/$run/checkpoints ] && echo --resume) "$@"
}
# the untrained model, for contrast
ev untrained default --speedups 1,2,3,4,5
# the shipped default-e2e: nested layer sets by measured influence with name augmentation, 1800 steps
# (recipes/default-e2e-names-aug-1800.yaml). Its run is scored on select first, to be chosen there
# (benchmarks/choose_on_select.py); benchmarks/ship_default_e2e.sh then copies it into the package,
# scores it on select and once on report, and calibrates its adaptive thresholds on select
[ -f $R/eval-select-default-e2e-names-aug-1800.json ] || { train default-e2e-names-aug-1800 recipes/default-e2e-names-aug-1800.yaml
  $BIN/skipdecode evaluate --task e2e --data $DATA --split select --model runs/default-e2e-names-aug-1800 \
    --speedups 1,2,3,4,5 --out $R/eval-select-default-e2e-names-aug-1800.json; }
[ -f $R/eval-report-default-e2e.json ] || benchmarks/ship_default_e2e.sh
# (ship_default_e2e.sh also calibrates and scores the adaptive thresholds: eval-*-default-e2e-adaptive.json)
# the shipped recipe at full depth only (--speedups 1), the reference the shipped model's 1x is held to:
# trained on one GPU by benchmarks/screen_weights_gpu.sh (here instead when runs/ does not hold it)
scored screen-names-aug-1800-ref || train gpu-names-aug-1800-ref recipes/default-e2e-names-aug-1800.yaml --speedups 1
ev screen-names-aug-1800-ref runs/gpu-names-aug-1800-ref --speedups 1
# SkipDecode's skip-the-bottom recipe, the default-e2e shipped before nested layer sets (its eval-*-default-e2e-skip*.json
# and adaptive thresholds came from ship_default_e2e.sh when it shipped that recipe)
scored default-e2e-skip || train default-e2e-skip recipes/default-e2e.yaml
ev default-e2e-skip runs/default-e2e-skip --speedups 1,2,3,4,5
# nested layer sets by measured influence without name augmentation, the default-e2e shipped before
# (its eval-*-default-e2e-nested-adaptive.json and adaptive thresholds came from ship_default_e2e.sh
# when it shipped that recipe)
scored default-e2e-nested || train default-e2e-nested recipes/default-e2e-nested.yaml
ev default-e2e-nested runs/default-e2e-nested --speedups 1,2,3,4,5
# the same with the layer order measured by greedy removal (SLEB-style) instead of Block Influence
scored default-e2e-nested-removal || train default-e2e-nested-removal recipes/default-e2e-nested-removal.yaml
ev default-e2e-nested-removal runs/default-e2e-nested-removal --speedups 1,2,3,4,5
# The full-depth-only reference, early exit and static drop to 15 layers take hours on 2 CPU
# cores: benchmarks/quality_heldout_gpu.sh trains them on one GPU (train --device cuda), with the
# skip-the-bottom recipe retrained there as the same-hardware control and both again at seeds 1 and 2;
# the train lines below train them here instead when runs/ does not hold them.
# the full-depth-only reference: the skip-the-bottom recipe at 1x only
scored full-only || train heldout-full-only recipes/default-e2e.yaml --speedups 1
ev full-only runs/heldout-full-only --speedups 1
# the skip-the-bottom recipe trained on the GPU beside the reference, and both at two more seeds
scored default-e2e-cuda || train default-e2e-cuda recipes/default-e2e.yaml
ev default-e2e-cuda runs/default-e2e-cuda --speedups 1,2,3,4,5
for seed in 1 2; do
  scored full-only-seed$seed || train heldout-full-only-seed$seed recipes/default-e2e.yaml --speedups 1 --seed $seed
  ev full-only-seed$seed runs/heldout-full-only-seed$seed --speedups 1
  scored default-e2e-cuda-seed$seed || train default-e2e-cuda-seed$seed recipes/default-e2e.yaml --seed $seed
  ev default-e2e-cuda-seed$seed runs/default-e2e-cuda-seed$seed --speedups 1,2,3,4,5
done
# early exit with the same monotone budgets, the skip-the-bottom recipe with --mode early_exit
scored early-exit || train heldout-early-exit recipes/default-e2e.yaml --mode early_exit
ev early-exit runs/heldout-early-exit --speedups 1,2,3,4,5
# static layer drop (ShortGPT), one pruned model per speedup, fine-tuned at its own depth
for x in 2 3 5; do
  scored drop-${x}x && continue
  [ -f runs/heldout-drop-${x}x-base/config.json ] || $BIN/skipdecode prune --model default --data e2e-heldout \
    --speedup $x -o runs/heldout-drop-${x}x-base
  train heldout-drop-${x}x recipes/default-e2e.yaml --model runs/heldout-drop-${x}x-base --speedups 1
  ev drop-${x}x runs/heldout-drop-${x}x --speedups 1
done
# the 0.5B model with the shipped recipe (benchmarks/ship_qwen05b_e2e.sh), and its base untrained at 1x
[ -f $R/eval-report-qwen2.5-coder-0.5b-e2e.json ] || benchmarks/ship_qwen05b_e2e.sh
ev qwen2.5-coder-0.5b-untrained qwen2.5-coder-0.5b --speedups 1
# the 0.5B model with a gentler recipe (lr 3e-4, 300 steps; recipes/qwen2.5-coder-0.5b-e2e-gentle.yaml)
scored qwen2.5-coder-0.5b-e2e-gentle || train qwen2.5-coder-0.5b-e2e-gentle recipes/qwen2.5-coder-0.5b-e2e-gentle.yaml
ev qwen2.5-coder-0.5b-e2e-gentle runs/qwen2.5-coder-0.5b-e2e-gentle --speedups 1,2,3,4,5
$BIN/skipdecode bench --quality
