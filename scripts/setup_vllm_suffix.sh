#!/usr/bin/env bash
# Optional, after scripts/setup_vllm.sh: vLLM's `suffix` speculative method, which needs the arctic-inference
# package (vLLM 0.32 imports arctic_inference.suffix_decoding for that method only). PyPI has it only as the
# 0.3.0 source distribution (a C++ suffix tree built with CMake and nanobind; its build requirements pin
# torch>=2.10 from PyPI, so it is built here without build isolation against the vLLM venv's CPU torch).
# It goes into its own environment, $DRAFTKIT_CACHE/vllm-suffix-venv: a venv that sees the vLLM venv's
# packages through a .pth file, so the vLLM venv is left as it is. draftkit serves `suffix` from there
# (draftkit/engines/vllm.py: find_suffix_python); the other methods keep the vLLM venv.
# Needs g++ (C++20) and ~1 minute of compiling; a second run returns at once.
# The package also registers a vLLM plugin (vllm.general_plugins); it does nothing unless
# ARCTIC_INFERENCE_ENABLED is set, and then only on CUDA with vLLM 0.26.0.
set -euo pipefail
CACHE="${DRAFTKIT_CACHE:-$HOME/.cache/draftkit}"
BASE="${DRAFTKIT_VLLM_VENV:-$CACHE/vllm-venv}"
VENV="${DRAFTKIT_VLLM_SUFFIX_VENV:-$CACHE/vllm-suffix-venv}"
ready() { "$VENV/bin/python" -c "import vllm; from arctic_inference.suffix_decoding import SuffixDecodingCache; print(vllm.__version__)" 2>/dev/null | tail -1; }
if [ -x "$VENV/bin/python" ] && v=$(ready) && [ -n "$v" ]; then echo "setup_vllm_suffix: $VENV ready (vllm $v)"; exit 0; fi
[ -x "$BASE/bin/python" ] || bash "$(dirname "$0")/setup_vllm.sh"
command -v g++ >/dev/null || { echo "setup_vllm_suffix: g++ not found (arctic-inference compiles C++20): apt-get install g++" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$("$BASE/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
site() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
site "$BASE/bin/python" > "$(site "$VENV/bin/python")/zz_draftkit_vllm_venv.pth"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --no-compile "setuptools>=61" wheel ninja "cmake>=3.18" "nanobind==2.9.2" grpcio-tools
CMAKE_ARGS="-DPython_EXECUTABLE=$VENV/bin/python" pip install -q --no-compile --no-build-isolation --no-deps \
  "arctic-inference==0.3.0"
v=$(ready) && [ -n "$v" ] || { echo "setup_vllm_suffix: arctic-inference installed in $VENV but the import fails" >&2; exit 1; }
echo "setup_vllm_suffix: $VENV ready (vllm $v, arctic-inference 0.3.0)"
