#!/usr/bin/env bash
# The SciTLDR study (a shorter run): LoRA skip-aware training on SciTLDR train
# (abstract -> TL;DR), scored on the first 100 papers of its dev split against
# every TL;DR of a paper, with the untrained default model for contrast.
# Writes benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
RUN=runs/default-scitldr
TRAIN="skipdecode train --config recipes/scitldr-lora.yaml -o $RUN"

[ -f "$RUN/adapter_model.safetensors" ] || $BIN/$TRAIN
EXP=$($BIN/python -c "import json; print(json.load(open('$RUN/skipdecode.json'))['expected_new_tokens'])")
EVAL_TUNED="skipdecode evaluate --task scitldr --data $DEV --limit 100 --model $RUN --speedups 1,2,3 --out benchmarks/results/eval-scitldr-tuned.json"
EVAL_BASE="skipdecode evaluate --task scitldr --data $DEV --limit 100 --model default --speedups 1,2,3 --expected-new-tokens $EXP --out benchmarks/results/eval-scitldr-default.json"
$BIN/$EVAL_TUNED
$BIN/$EVAL_BASE
bash benchmarks/report_scitldr.sh
