#!/usr/bin/env bash
# Training step time on the CPU: one step (forward + backward + AdamW) of the
# quality recipe (LoRA r=32, 16 E2E examples) at full depth and at 3x,
# alternating, in fp32 and with --mixed-precision bf16 (torch.autocast; AMX
# where present), each with glibc malloc as it comes (SKIPDECODE_MALLOC_TUNING=0)
# and as training tunes it (skipdecode/allocator.py). Writes
# benchmarks/results/train-step-time-{fp32,bf16}[-malloc-default].json.
# Run from the repository root on a quiet machine.
set -euo pipefail
export HF_HUB_OFFLINE=1
for mp in no bf16; do
  for tune in 0 1; do
    name=$([ $mp = no ] && echo fp32 || echo bf16)$([ $tune = 0 ] && echo -malloc-default || true)
    SKIPDECODE_MALLOC_TUNING=$tune .venv/bin/skipdecode train --model default --data e2e-names --lora \
      --lora-r 32 --lora-alpha 64 --measure-step-time --batch-size 16 --measure-repeats 5 --mixed-precision $mp \
      > benchmarks/results/train-step-time-$name.json.tmp
    mv benchmarks/results/train-step-time-$name.json.tmp benchmarks/results/train-step-time-$name.json
  done
done
