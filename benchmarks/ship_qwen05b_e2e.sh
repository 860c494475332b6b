#!/usr/bin/env bash
# The skip-trained Qwen2.5-Coder-0.5B-Instruct (recipes/qwen2.5-coder-0.5b-e2e.yaml:
# the default-e2e recipe on the 0.5B model, bf16 autocast). Trains (or resumes)
# the run, ships the LoRA adapter in bf16 (about 35 MB) with its training log
# into src/skipdecode/models/qwen2.5-coder-0.5b-e2e (its base is pulled by name:
# `skipdecode pull qwen2.5-coder-0.5b`), then scores it at 1x-5x on select
# (where choices are made) and once on report (never chosen on).
# About 3.75 h of training on 2 CPU cores: run it in pieces; a killed run resumes.
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
RUN=runs/qwen2.5-coder-0.5b-e2e
SHIP=src/skipdecode/models/qwen2.5-coder-0.5b-e2e
R=benchmarks/results

$BIN/skipdecode pull qwen2.5-coder-0.5b
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/qwen2.5-coder-0.5b-e2e.yaml \
  -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
mkdir -p "$SHIP"
for f in adapter_config.json skipdecode.json train_log.jsonl; do
  cp "$RUN/$f" "$SHIP/$f.tmp" && mv "$SHIP/$f.tmp" "$SHIP/$f"
done
$BIN/python - "$RUN/adapter_model.safetensors" "$SHIP/adapter_model.safetensors" <<'PY'
import os, sys
import torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1:]
save_file({k: v.to(torch.bfloat16) for k, v in load_file(src).items()}, dst + ".tmp", metadata={"format": "pt"})
os.replace(dst + ".tmp", dst)
PY
cp "$RUN/train_log.jsonl" $R/train-log-qwen2.5-coder-0.5b-e2e.jsonl
for split in select report; do
  $BIN/skipdecode evaluate --task e2e --data ../shared/data/e2e/devset.csv --split $split \
    --model "$SHIP" --speedups 1,2,3,4,5 --out $R/eval-$split-qwen2.5-coder-0.5b-e2e.json
done
