#!/usr/bin/env bash
# Mixed precision on the CPU: one training step (forward + backward + AdamW) of
# the quality recipe (LoRA r=32, 16 E2E examples) at full depth and at 3x, in
# fp32 and with --mixed-precision bf16 (torch.autocast; AMX where present).
# Writes benchmarks/results/train-step-time-{fp32,bf16}.json. Run from the
# repository root on a quiet machine.
set -euo pipefail
export HF_HUB_OFFLINE=1
for mp in no bf16; do
  name=$([ $mp = no ] && echo fp32 || echo bf16)
  .venv/bin/skipdecode train --model default --data e2e-names --lora --lora-r 32 --lora-alpha 64 \
    --measure-step-time --batch-size 16 --measure-repeats 5 --mixed-precision $mp \
    > benchmarks/results/train-step-time-$name.json.tmp
  mv benchmarks/results/train-step-time-$name.json.tmp benchmarks/results/train-step-time-$name.json
done
