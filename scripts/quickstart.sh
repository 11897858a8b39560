#!/usr/bin/env bash
# The README's main job: set up, distill an EAGLE head from the embedded SmolLM2-135M target with
# DeepSpeed, export it, and measure its real acceptance and speedup with `draftkit eval`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE="${WANDB_MODE:-offline}"
.venv/bin/deepspeed --master_port "${MASTER_PORT:-29500}" draftkit/train/run.py recipes/quick.yaml "$@"
# --draft auto (the default): measures verify/draft cost and acceptance once, picks chain/tree/hybrid sizes,
# writes them to runs/quick/eval/draft.json (reused by the next eval with this --out; the head is not touched),
# then compares plain, lookup, head and hybrid side by side. --dtype auto (the default): bf16 where the CPU/GPU
# multiplies it natively, else fp32.
.venv/bin/draftkit eval --head runs/quick/head --num-synthesized 8 --max-new-tokens 64 --out runs/quick/eval
