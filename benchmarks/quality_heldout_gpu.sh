#!/usr/bin/env bash
# The held-out rows that take hours on 2 CPU cores, trained on one CUDA GPU
# (`skipdecode train --device cuda`: fp32, TF32 off, the same data order and
# schedule draws as on the CPU), four runs side by side:
#   - heldout-full-only:  the full-depth-only reference, the shipped recipe at 1x only;
#   - heldout-early-exit: early exit with the same monotone budgets, the shipped recipe;
#   - heldout-drop-2x:    static drop to 15 layers (ShortGPT), fine-tuned at its own depth;
#   - default-e2e-cuda:   the shipped recipe itself, on the same GPU: the control that
#                         separates "trained on a GPU" from "trained at 1x only";
#   - and the reference and the control again with seeds 1 and 2.
# Each writes runs/NAME (a LoRA adapter and its train_log.jsonl) and runs/NAME.log.
# They are scored on the CPU with the `ev` lines of benchmarks/quality_heldout.sh,
# which skip their training when runs/NAME holds the finished adapter. A killed
# run resumes when the script is run again. Run from the repository root.
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
SD=${SKIPDECODE:-skipdecode}
RECIPE=recipes/default-e2e.yaml
mkdir -p runs
run() {  # run NAME [train flags...]: train (or resume, or skip when finished) on the GPU
  local name=$1; shift
  [ -f runs/$name/adapter_model.safetensors ] && return 0
  $SD train --config $RECIPE -o runs/$name --device cuda $([ -d runs/$name/checkpoints ] && echo --resume) "$@" \
    >> runs/$name.log 2>&1
}
$SD --version  # fail early when the command is missing
pids=()
run heldout-full-only --speedups 1 & pids+=($!)
run heldout-early-exit --mode early_exit & pids+=($!)
run default-e2e-cuda & pids+=($!)
# two more seeds (data order, schedule draws, LoRA init) of the reference and its control: how far
# two runs of one recipe land apart, the noise floor of "1x within 1 BLEU of the reference"
run heldout-full-only-seed1 --speedups 1 --seed 1 & pids+=($!)
run default-e2e-cuda-seed1 --seed 1 & pids+=($!)
run heldout-full-only-seed2 --speedups 1 --seed 2 & pids+=($!)
run default-e2e-cuda-seed2 --seed 2 & pids+=($!)
( [ -f runs/heldout-drop-2x-base/config.json ] || OMP_NUM_THREADS=8 $SD prune --model default --data e2e-heldout --speedup 2 \
    -o runs/heldout-drop-2x-base > runs/heldout-drop-2x-base.json
  run heldout-drop-2x --model runs/heldout-drop-2x-base --speedups 1 ) & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
tail -n 2 runs/*.log
exit $status
