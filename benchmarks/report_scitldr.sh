#!/usr/bin/env bash
# Render benchmarks/results/train-scitldr.{json,md} from the evaluation files the
# SciTLDR scripts wrote (each row appears once its script has run). "Kept"
# divides by the 1x score of the full-depth-only fine-tuned model when it
# exists (the paper's reference; else by the same model's 1x), and the own-1x
# fraction is shown beside it. A run's training summary is saved beside the
# results, so the report re-renders where runs/ is gone.
set -euo pipefail
BIN=.venv/bin
R=benchmarks/results
ARGS=()
add() {  # NAME EVAL_FILE TRAIN_DIR SUMMARY_FILE
  [ -f "$2" ] || return 0
  ARGS+=(--eval "$1=$2")
  if [ -f "$3/skipdecode.json" ] && [ -f "$3/train_log.jsonl" ]; then
    $BIN/python -c "import json, sys; from pathlib import Path; from skipdecode.evaluation.report import train_summary
Path(sys.argv[2]).write_text(json.dumps(train_summary(Path(sys.argv[1])), indent=2) + '\n')" "$3" "$4"
  fi
  [ -f "$4" ] && ARGS+=(--train "$1=$4")
  return 0
}
add "full FT, 1x only, --decay 1.25" $R/eval-scitldr-full-only1x.json \
  runs/scitldr-full-only1x $R/train-summary-scitldr-full-only1x.json
add "full FT, one checkpoint for 1x/2x/3x, --decay 1.25" $R/eval-scitldr-full123-gentle.json \
  runs/scitldr-full123-gentle $R/train-summary-scitldr-full123-gentle.json
add "full FT, one checkpoint for 1x/2x, --decay 1.25" $R/eval-scitldr-full12-gentle.json \
  runs/scitldr-full12-gentle $R/train-summary-scitldr-full12-gentle.json
add "full FT, 2x only, --decay 1.25" $R/eval-scitldr-full-only2x.json \
  runs/scitldr-full-only2x $R/train-summary-scitldr-full-only2x.json
add "LoRA r16, one checkpoint for 1x/2x/3x" $R/eval-scitldr-tuned.json runs/default-scitldr \
  $R/train-summary-scitldr-lora.json
add "LoRA r32, 1x drawn twice, one checkpoint for 1x/2x/3x, --decay 1.25" $R/eval-scitldr-lora32-weighted.json \
  runs/scitldr-lora32-weighted $R/train-summary-scitldr-lora32-weighted.json
add "full FT, front-loaded (--horizon 3 --decay 5), 1x drawn twice, one checkpoint for 1x/2x/3x" \
  $R/eval-scitldr-full-front.json runs/scitldr-full-front $R/train-summary-scitldr-full-front.json
add "full FT, flat budget (--decay 1), one checkpoint for 1x/2x/3x" \
  $R/eval-scitldr-full-flat.json runs/scitldr-full-flat $R/train-summary-scitldr-full-flat.json
add "default (not fine-tuned)" $R/eval-scitldr-default.json "" ""
[ -f $R/eval-scitldr-full-only1x.json ] && ARGS+=(--reference "full FT, 1x only, --decay 1.25")
$BIN/python -m skipdecode.evaluation.report --title "SciTLDR (SmolLM2-135M-Instruct)" "${ARGS[@]}" \
  --command "bash benchmarks/train_scitldr_full.sh" \
  --command "SPEEDUPS=1,2 bash benchmarks/train_scitldr_full.sh" \
  --command "bash benchmarks/train_scitldr_per_speedup_full.sh   # the 1x-only reference and the 2x-only rows" \
  --command "bash benchmarks/train_scitldr.sh   # the LoRA and the not-fine-tuned rows" \
  --command "bash benchmarks/train_scitldr_lora_best.sh   # the shipped E2E recipe" \
  --command "bash benchmarks/train_scitldr_run.sh full-front 1,1,2,3 -- --horizon 3 --decay 5" \
  --command "bash benchmarks/train_scitldr_run.sh full-flat 1,2,3 -- --decay 1" \
  --command "bash benchmarks/report_scitldr.sh" \
  --out $R/train-scitldr
