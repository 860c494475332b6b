#!/usr/bin/env bash
# Render benchmarks/results/train-e2e.{json,md} from the evaluation files the
# E2E scripts wrote (each row appears once its script has run). "Kept" divides
# by the 1x score of the full-depth-only fine-tuned model when it exists (the
# paper's reference), and the own-1x fraction is shown beside it. A run's
# training summary is saved beside the results, so the report re-renders
# where runs/ is gone.
set -euo pipefail
BIN=.venv/bin
R=benchmarks/results
ARGS=()
add() {  # NAME EVAL_FILE TRAIN_DIR SUMMARY_FILE
  [ -f "$2" ] || return 0
  ARGS+=(--eval "$1=$2")
  if [ -n "$3" ] && [ -f "$3/skipdecode.json" ] && [ -f "$3/train_log.jsonl" ]; then
    $BIN/python -c "import json, sys; from pathlib import Path; from skipdecode.evaluation.report import train_summary
Path(sys.argv[2]).write_text(json.dumps(train_summary(Path(sys.argv[1])), indent=2) + '\n')" "$3" "$4"
  fi
  [ -n "$4" ] && [ -f "$4" ] && ARGS+=(--train "$1=$4")
  return 0
}
add "full FT, 1x only" $R/eval-e2e-full-only1x.json runs/e2e-full-only1x $R/train-summary-e2e-full-only1x.json
add "full FT, one checkpoint for 1x/2x/3x" $R/eval-e2e-full123.json runs/e2e-full123 $R/train-summary-e2e-full123.json
add "full FT, one checkpoint for 1x/2x/3x, gentle schedules (--decay 1.25)" $R/eval-e2e-full123-gentle.json \
  runs/e2e-full123-gentle $R/train-summary-e2e-full123-gentle.json
add "full FT, 2x only" $R/eval-e2e-full-only2x.json runs/e2e-full-only2x $R/train-summary-e2e-full-only2x.json
add "LoRA r=16, one checkpoint for 1x-5x (the earlier shipped default-e2e)" $R/eval-e2e-lora16-1to5.json \
  runs/e2e-lora16-1to5 $R/train-summary-e2e-lora16-1to5.json
add "LoRA, one checkpoint for 1x/2x/3x, gentle schedules (--decay 1.25)" $R/eval-e2e-lora-gentle.json \
  runs/e2e-lora-gentle $R/train-summary-e2e-lora-gentle.json
add "LoRA, 2x only" $R/eval-e2e-only2x.json runs/e2e-only2x $R/train-summary-e2e-lora-only2x.json
add "default (not fine-tuned)" $R/eval-e2e-default.json "" ""
[ -f $R/eval-e2e-full-only1x.json ] && ARGS+=(--reference "full FT, 1x only")
$BIN/python -m skipdecode.evaluation.report --title "E2E (SmolLM2-135M-Instruct)" "${ARGS[@]}" \
  --command "bash benchmarks/train_e2e_full.sh" \
  --command "bash benchmarks/train_e2e_gentle.sh" \
  --command "bash benchmarks/train_e2e_per_speedup_full.sh" \
  --command "bash benchmarks/train_e2e.sh   # the LoRA 1x-5x (earlier shipped) and the not-fine-tuned rows" \
  --command "bash benchmarks/train_e2e_lora_gentle.sh" \
  --command "bash benchmarks/train_e2e_per_speedup.sh" \
  --command "bash benchmarks/report_e2e.sh" \
  --out $R/train-e2e
