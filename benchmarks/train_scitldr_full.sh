#!/usr/bin/env bash
# SciTLDR with the E2E recipe that kept quality (benchmarks/train_e2e_gentle.sh):
# full fine-tuning, schedules drawn per batch from SPEEDUPS (default {1x, 2x, 3x};
# SPEEDUPS=1,2 gives 2x half the steps instead of a third), gentle solved
# schedules (--decay 1.25), lr 2e-4, 200 steps of 8 (benchmarks/train_scitldr_run.sh).
# Scored on the first 100 dev papers (max over TL;DRs) at each trained speedup.
# About 1 h of training on 2 CPU cores. Writes
# benchmarks/results/eval-scitldr-full<SPEEDUPS>-gentle.json and re-renders
# benchmarks/results/train-scitldr.{json,md}. Run from the repository root.
set -euo pipefail
SPEEDUPS=${SPEEDUPS:-1,2,3}
exec bash benchmarks/train_scitldr_run.sh "full${SPEEDUPS//,/}-gentle" "$SPEEDUPS" -- --decay 1.25
