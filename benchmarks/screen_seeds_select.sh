#!/usr/bin/env bash
# Scores the GPU runs of benchmarks/screen_seeds_gpu.sh (the shipped recipe at seeds 1-3) on
# e2e-heldout's select part at 1x-5x (benchmarks/screen_select.sh).
# Then, with every earlier candidate (benchmarks/results/choice-on-select.json):
#   .venv/bin/python benchmarks/choose_on_select.py default-e2e-skip default-e2e-nested \
#     default-e2e-nested-removal default-e2e-names-aug-1800 screen-names-aug-1800-gpu \
#     screen-names-aug-1800-2x2 screen-names-aug-1800-2x2-5x2 screen-names-aug-1800-seed1 \
#     screen-names-aug-1800-seed2 screen-names-aug-1800-seed3
# Run from the repository root.
exec "$(dirname "$0")/screen_select.sh" names-aug-1800-seed1 names-aug-1800-seed2 names-aug-1800-seed3
