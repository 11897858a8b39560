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
# The served figure: the same head in vLLM (CPU build, its own venv) beside vLLM plain, vLLM's ngram and our loop
# under vLLM's rule (a chain of 3, greedy drafts), per position with the tolerance. Where vLLM is not installed,
# say how to get it (scripts/setup_vllm.sh: ~3.5 GB, a few minutes) instead of failing the main job.
if .venv/bin/python -c "from draftkit.engines.vllm import find_python; find_python()" 2>/dev/null; then
  .venv/bin/draftkit eval --engine vllm --head runs/quick/head --num-synthesized 8 --max-new-tokens 64 --k 3 \
      --out runs/quick/eval_vllm
else
  echo "vLLM is not installed: bash scripts/setup_vllm.sh, then the served figure is:"
  echo "  .venv/bin/draftkit eval --engine vllm --head runs/quick/head --num-synthesized 8 --max-new-tokens 64 --k 3 --out runs/quick/eval_vllm"
fi
