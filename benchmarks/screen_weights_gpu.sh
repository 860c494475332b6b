#!/usr/bin/env bash
# The shipped default-e2e recipe (recipes/default-e2e-names-aug-1800.yaml) on one CUDA GPU with
# the right end token (<|im_end|>; the earlier GPU screen ended answers with <|im_start|>), four
# runs side by side (`skipdecode train --device cuda`: fp32, TF32 off, the CPU's data order and
# schedule draws):
#   - names-aug-1800-ref:      the recipe at full depth only (--speedups 1): the reference the
#                              shipped model's 1x is held to;
#   - names-aug-1800-gpu:      the recipe itself: how far a second training of it lands (control);
#   - names-aug-1800-2x2:      one lever, 2x drawn twice as often (speedups 1 1 2 2 3 4 5), since
#                              2x is the target the shipped recipe misses most on select and report;
#   - names-aug-1800-2x2-5x2:  2x and 5x each drawn twice as often (1 1 2 2 3 4 5 5).
# Each writes runs/gpu-NAME (a LoRA adapter and its train_log.jsonl) and runs/gpu-NAME.log; a
# killed run resumes when the script is run again. benchmarks/screen_weights_select.sh scores
# them on the CPU. Run from the repository root.
RECIPE=recipes/default-e2e-names-aug-1800.yaml
source benchmarks/gpu_runs.sh
start names-aug-1800-ref --speedups 1
start names-aug-1800-gpu
start names-aug-1800-2x2 --speedups 1 1 2 2 3 4 5
start names-aug-1800-2x2-5x2 --speedups 1 1 2 2 3 4 5 5
finish
