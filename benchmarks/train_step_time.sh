#!/usr/bin/env bash
# Training pays the skip saving too: one step (forward + backward + AdamW, full
# fine-tuning) at full depth vs a 3x schedule on the same 16 E2E examples.
# Writes benchmarks/results/train-step-time.json. Run from the repository root.
set -euo pipefail
HF_HUB_OFFLINE=1 .venv/bin/skipdecode train --model default --data e2e --measure-step-time \
  --batch-size 16 --measure-repeats 3 > benchmarks/results/train-step-time.json
