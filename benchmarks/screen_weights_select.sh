#!/usr/bin/env bash
# Scores the four GPU runs of benchmarks/screen_weights_gpu.sh (benchmarks/screen_select.sh): the
# control and the two speedup-weighting levers on e2e-heldout's select part at 1x-5x, the
# full-depth-only reference at 1x on select and on report (eval-report-screen-names-aug-1800-ref.json).
# Then, with every earlier candidate (benchmarks/results/choice-on-select.json):
#   .venv/bin/python benchmarks/choose_on_select.py default-e2e-skip default-e2e-nested \
#     default-e2e-nested-removal default-e2e-names-aug-1800 screen-names-aug-1800-gpu \
#     screen-names-aug-1800-2x2 screen-names-aug-1800-2x2-5x2
# Run from the repository root.
exec "$(dirname "$0")/screen_select.sh" names-aug-1800-gpu names-aug-1800-2x2 names-aug-1800-2x2-5x2 \
  names-aug-1800-ref
