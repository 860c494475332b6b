#!/usr/bin/env bash
# The shipped default-e2e recipe (recipes/default-e2e-names-aug-1800.yaml) again on one CUDA GPU,
# four runs side by side (`skipdecode train --device cuda`: fp32, TF32 off, the CPU's data order
# and schedule draws), each one variable away from the recipe:
#   - names-aug-1800-seed1, -seed2, -seed3: the recipe at seeds 1-3 (data order, schedule draws,
#     LoRA init): how far runs of one recipe land apart on select, and candidates to choose
#     among on select only (the recipe's seed-0 runs are default-e2e and names-aug-1800-gpu);
#   - names-aug-1800-distill: self-distillation (--distill 0.5): each skipped step also learns the
#     same model's full-depth distribution (no gradient through the teacher), which aims straight
#     at "kept of own 1x".
# Each writes runs/gpu-NAME (a LoRA adapter and its train_log.jsonl) and runs/gpu-NAME.log; a
# killed run resumes when the script is run again. benchmarks/screen_seeds_select.sh scores
# them on the CPU. Run from the repository root.
RECIPE=recipes/default-e2e-names-aug-1800.yaml
source benchmarks/gpu_runs.sh
start names-aug-1800-seed1 --seed 1
start names-aug-1800-seed2 --seed 2
start names-aug-1800-seed3 --seed 3
start names-aug-1800-distill --distill 0.5
finish
