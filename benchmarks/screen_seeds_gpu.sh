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
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
SD=${SKIPDECODE:-skipdecode}
RECIPE=recipes/default-e2e-names-aug-1800.yaml
mkdir -p runs
run() {  # run NAME [train flags...]: train (or resume, or skip when finished) on the GPU
  local name=$1; shift
  local dir=runs/gpu-$name
  [ -f $dir/adapter_model.safetensors ] && return 0
  $SD train --config $RECIPE -o $dir --device cuda $([ -d $dir/checkpoints ] && echo --resume) "$@" \
    >> $dir.log 2>&1
}
$SD --version  # fail early when the command is missing
pids=()
run names-aug-1800-seed1 --seed 1 & pids+=($!)
run names-aug-1800-seed2 --seed 2 & pids+=($!)
run names-aug-1800-seed3 --seed 3 & pids+=($!)
run names-aug-1800-distill --distill 0.5 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
tail -n 2 runs/gpu-names-aug-1800-*.log
exit $status
