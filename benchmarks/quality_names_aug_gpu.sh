#!/usr/bin/env bash
# Two levers on the shipped recipe (recipes/default-e2e-nested.yaml), each with its own
# full-depth-only reference (the same recipe at 1x only, --speedups 1), trained side by
# side on one CUDA GPU (`skipdecode train --device cuda`: fp32, TF32 off, the CPU's data
# order and schedule draws):
#   - default-e2e-names-aug:       name augmentation (recipes/default-e2e-names-aug.yaml);
#   - default-e2e-nested-1800:     twice the steps (1800 of 16, about 8.8 epochs);
#   - default-e2e-names-aug-1800:  both;
#   - heldout-full-only-{names-aug,1800,names-aug-1800}: their references.
# (The 900-step reference of the shipped recipe is heldout-full-only, quality_heldout_gpu.sh.)
# Each writes runs/gpu-NAME (a LoRA adapter and its train_log.jsonl) and runs/gpu-NAME.log;
# a killed run resumes when the script is run again. benchmarks/screen_names_aug_gpu.sh
# scores them on select, on the CPU.
# Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
SD=${SKIPDECODE:-skipdecode}
mkdir -p runs
run() {  # run NAME RECIPE [train flags...]: train (or resume, or skip when finished) on the GPU
  local name=$1 recipe=$2; shift 2
  local dir=runs/gpu-$name
  [ -f $dir/adapter_model.safetensors ] && return 0
  $SD train --config $recipe -o $dir --device cuda $([ -d $dir/checkpoints ] && echo --resume) "$@" \
    >> $dir.log 2>&1
}
$SD --version  # fail early when the command is missing
NESTED=recipes/default-e2e-nested.yaml AUG=recipes/default-e2e-names-aug.yaml
pids=()
run default-e2e-names-aug $AUG & pids+=($!)
run heldout-full-only-names-aug $AUG --speedups 1 & pids+=($!)
run default-e2e-nested-1800 $NESTED --steps 1800 & pids+=($!)
run heldout-full-only-1800 $NESTED --steps 1800 --speedups 1 & pids+=($!)
run default-e2e-names-aug-1800 $AUG --steps 1800 & pids+=($!)
run heldout-full-only-names-aug-1800 $AUG --steps 1800 --speedups 1 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
tail -n 2 runs/gpu-*.log
exit $status
