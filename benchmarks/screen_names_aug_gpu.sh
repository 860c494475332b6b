#!/usr/bin/env bash
# Scores the six GPU runs of benchmarks/quality_names_aug_gpu.sh on e2e-heldout's select
# part (where choices are made): the three candidates at 1x-5x, their references at 1x.
# Those runs were trained where transformers 5.17 converted the default model and made
# its EOS <|im_start|> (id 1) instead of <|im_end|> (id 2): they end answers with
# <|im_start|>. So each merged model here also stops at id 1 (a generation_config.json
# beside it); apart from the end token the runs saw the CPU's data, schedules and prompts. Their
# adapters came back from the GPU machine rounded to bf16 (the files scored here).
# A screen of the levers, never shipped: skipdecode's conversion now pins the GGUF's own
# special-token ids, so a rerun trains the right EOS. Run from the repository root.
# Writes benchmarks/results/eval-select-screen-NAME.json and train-log-screen-NAME.jsonl (and, last,
# eval-report-screen-heldout-full-only-names-aug-1800.json).
set -euo pipefail
export HF_HUB_OFFLINE=1
R=benchmarks/results DATA=../shared/data/e2e/devset.csv
for m in default-e2e-names-aug default-e2e-nested-1800 default-e2e-names-aug-1800 heldout-full-only-names-aug \
         heldout-full-only-1800 heldout-full-only-names-aug-1800; do
  p=$(.venv/bin/python -c "from skipdecode.checkpoint import resolve; print(resolve('runs/gpu-$m'))" 2>/dev/null | tail -1)
  echo '{"eos_token_id": [1, 2]}' > "$p/generation_config.json"
  sp=1,2,3,4,5; case $m in heldout-*) sp=1;; esac
  cp runs/gpu-$m/train_log.jsonl $R/train-log-screen-$m.jsonl
  [ -f $R/eval-select-screen-$m.json ] || .venv/bin/skipdecode evaluate --task e2e --data $DATA --split select \
    --model runs/gpu-$m --speedups $sp --out $R/eval-select-screen-$m.json
done
# The shipped default-e2e's recipe at full depth only (1800 steps with renaming) is the reference its 1x is
# held to; a reference is compared with, never chosen, so it is also scored on report (1x only).
[ -f $R/eval-report-screen-heldout-full-only-names-aug-1800.json ] || .venv/bin/skipdecode evaluate --task e2e \
  --data $DATA --split report --model runs/gpu-heldout-full-only-names-aug-1800 --speedups 1 \
  --out $R/eval-report-screen-heldout-full-only-names-aug-1800.json
