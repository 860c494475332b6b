#!/usr/bin/env bash
# SciTLDR with the recipe of the shipped E2E checkpoint (benchmarks/ship_default_e2e.sh):
# LoRA r=32 (alpha 64) on all block linears, gentle schedules (--decay 1.25),
# schedules drawn per batch with 1x twice as often as 2x and 3x, lr 1e-3;
# 100 steps of 8 (long prompts make a step about 18 s on 2 CPU cores, so about
# 30-40 min). Scored on the first 100 dev papers (max over TL;DRs) at 1x/2x/3x.
# Writes benchmarks/results/eval-scitldr-lora32-weighted.json and re-renders
# benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1
BIN=.venv/bin
DEV=../shared/data/scitldr/dev.jsonl
RUN=runs/scitldr-lora32-weighted
[ -f "$RUN/adapter_model.safetensors" ] || $BIN/skipdecode train --config recipes/scitldr-lora.yaml \
  --lora-r 32 --lora-alpha 64 --speedups 1,1,2,3 --decay 1.25 --steps 100 --save-every 10 -o "$RUN" $([ -d "$RUN/checkpoints" ] && echo --resume)
$BIN/skipdecode evaluate --task scitldr --data $DEV --limit 100 --model "$RUN" --speedups 1,2,3 \
  --out benchmarks/results/eval-scitldr-lora32-weighted.json
bash benchmarks/report_scitldr.sh
# the same checkpoint run with front-loaded schedules, no retraining (--horizon 3 --decay 5, the shape of the
# shipped E2E model): does spending the depth on the first tokens carry over from E2E to summaries?
[ -f benchmarks/results/eval-scitldr-lora32-weighted-front.json ] || $BIN/skipdecode evaluate --task scitldr \
  --data $DEV --limit 100 --model "$RUN" --speedups 2,3 --horizon 3 --decay 5 \
  --out benchmarks/results/eval-scitldr-lora32-weighted-front.json
