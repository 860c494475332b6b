#!/usr/bin/env bash
# The shipped `default-e2e` (recipes/default-e2e-names-aug-1800-seed2.yaml: the recipe below at
# seed 2, trained on one GPU by benchmarks/screen_seeds_gpu.sh): LoRA r=32 (alpha 64)
# on all block linears, 1800 steps of 16, lr 1e-3, on the training part of
# e2e-heldout (no example names a restaurant of its select or report part),
# one checkpoint for 1x-5x with 1x drawn twice as often, front-loaded
# schedules (--horizon 3 --decay 5: the first three answer tokens run deep),
# nested layer sets (budget b runs the b layers of highest Block Influence
# on the base model, in depth order), and name augmentation (half of the drawn
# examples get synthetic restaurant names, in the prompt and the reference).
# Chosen on select among skipping the bottom (recipes/default-e2e.yaml), nested
# by influence (recipes/default-e2e-nested.yaml), nested by greedy removal, nested
# with name augmentation at seed 0 (recipes/default-e2e-names-aug-1800.yaml, the model
# shipped before: its files are kept as eval-*-default-e2e-names-aug-1800*.json) and
# at seeds 1-3 (docs/results.md, choice-on-select.json).
# Copies the adapter (16-32 MB: bf16 from the GPU, fp32 from a CPU run) and its training log into the package, then
# scores the shipped model at 1x-5x on select (where choices are made) and
# once on report (never chosen on), and calibrates its adaptive thresholds on select.
# About 4.3 h of training on 2 CPU cores (in pieces: a killed run resumes).
# Another candidate ships the same way: RECIPE=recipes/X.yaml RUN=runs/X benchmarks/ship_default_e2e.sh
# (chosen on select only: the eval-select-*.json of each candidate, benchmarks/quality_heldout.sh).
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RECIPE=${RECIPE:-recipes/default-e2e-names-aug-1800-seed2.yaml}
RUN=${RUN:-runs/gpu-names-aug-1800-seed2}
CAL=runs/adaptive-cal-$(basename "$RUN")
SHIP=src/skipdecode/models/default-e2e
R=benchmarks/results

[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config "$RECIPE" \
  -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
mkdir -p "$SHIP"
for f in adapter_config.json adapter_model.safetensors skipdecode.json train_log.jsonl; do
  cp "$RUN/$f" "$SHIP/$f.tmp" && mv "$SHIP/$f.tmp" "$SHIP/$f"
done
cp "$RUN/train_log.jsonl" $R/train-log-default-e2e.jsonl
for split in select report; do
  $BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split $split \
    --model default-e2e --speedups 1,2,3,4,5 --out $R/eval-$split-default-e2e.json
done
# adaptive budgets: per target, the threshold at which stepping down the next deeper trained
# schedule ((t+1)x) achieves t on select (for the skip-the-bottom model, stepping down the 5x
# schedule alone kept 87% and 82% of the static schedules' select BLEU at 2x and 3x:
# eval-select-default-e2e-skip-adaptive-on5x.json; its first budget is 19 layers and its floor 5).
for pair in 2:3 3:4 4:5; do
  t=${pair%%:*}; s=${pair##*:}
  [ -f $CAL-${t}x-on${s}x.json ] || $BIN/skipdecode evaluate --task e2e \
    --data ../shared/data/e2e/devset.csv --split select --model default-e2e --calibrate-adaptive $t \
    --adaptive-schedule $s --out $CAL-${t}x-on${s}x.json
done
CAL=$CAL $BIN/python - <<'PY'
import json, os, pathlib
cal = {"adaptive": {}, "calibrated_on": None}
for t, s in ((2, 3), (3, 4), (4, 5)):
    d = json.loads(pathlib.Path(f"{os.environ['CAL']}-{t}x-on{s}x.json").read_text())
    cal["adaptive"].update(d["adaptive"])
    cal["calibrated_on"] = d["calibrated_on"]
pathlib.Path("benchmarks/results/adaptive-calibration-default-e2e.json").write_text(json.dumps(cal, indent=2) + "\n")
meta = pathlib.Path("src/skipdecode/models/default-e2e/skipdecode.json")
m = json.loads(meta.read_text())
m["adaptive"] = {k: {"schedule_speedup": v["schedule_speedup"], "threshold": v["threshold"]}
                 for k, v in cal["adaptive"].items()}
m["adaptive_calibrated_on"] = cal["calibrated_on"]
meta.write_text(json.dumps(m, indent=2) + "\n")
PY
for split in select report; do
  $BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split $split \
    --model default-e2e --speedups 2,3,4 --adaptive --out $R/eval-$split-default-e2e-adaptive.json
done
