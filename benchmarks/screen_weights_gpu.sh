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
run names-aug-1800-ref --speedups 1 & pids+=($!)
run names-aug-1800-gpu & pids+=($!)
run names-aug-1800-2x2 --speedups 1 1 2 2 3 4 5 & pids+=($!)
run names-aug-1800-2x2-5x2 --speedups 1 1 2 2 3 4 5 5 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
tail -n 2 runs/gpu-names-aug-1800-*.log
exit $status
