# Sourced by the GPU screens (benchmarks/screen_*_gpu.sh): runs of one recipe side by side on one
# CUDA GPU. Set RECIPE first; then `start NAME [train flags...]` per run and `finish` at the end.
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
SD=${SKIPDECODE:-skipdecode}
mkdir -p runs
$SD --version  # fail early when the command is missing
pids=() logs=()
run() {  # run NAME [train flags...]: train (or resume, or skip when finished) runs/gpu-NAME on the GPU
  local name=$1; shift
  local dir=runs/gpu-$name
  [ -f $dir/adapter_model.safetensors ] && return 0
  $SD train --config $RECIPE -o $dir --device cuda $([ -d $dir/checkpoints ] && echo --resume) "$@" \
    >> $dir.log 2>&1
}
start() { run "$@" & pids+=($!); logs+=(runs/gpu-$1.log); }
finish() {  # wait for every run; fail if any failed
  local status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  tail -n 2 "${logs[@]}"
  return $status
}
