#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite (unit + integration) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu WANDB_MODE=disabled
exec .venv/bin/python -m pytest -q -ra "$@"
