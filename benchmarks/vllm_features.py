"""Stage-2 features through vLLM's `extract_hidden_states` speculative method: does it run on CPU,
does it equal the HF target's features, and is it faster than the HF prefill draftkit runs today?

    python benchmarks/vllm_features.py --out benchmarks/results/vllm_features.json

How vLLM 0.32 hands the hidden states out (vllm/v1/spec_decode/extract_hidden_states.py,
vllm/model_executor/models/extract_hidden_states.py, .../kv_connector/v1/example_hidden_states_connector.py):
speculative_config {method: extract_hidden_states, num_speculative_tokens: 1, draft_model_config:
{hf_config: {eagle_aux_hidden_state_layer_ids: [...]}}} makes the target return the residual stream
`hidden_states + residual` entering each listed layer (id N = the last layer's output, before the
final norm); a cache-only attention layer stores them in the KV cache, and a KV connector
(ExampleHiddenStatesConnector, kv_role kv_producer) copies a finished request's slots to
`<shared_storage_path>/<request id>.safetensors` {hidden_states (T, layers, H), token_ids (T)}.
Each sample is a prompt of its full token ids, generated for max_tokens=1 (one prefill).

Three steps, each its own vLLM process (vllm-venv python, draftkit/engines/vllm.py find_python):
1. the stock connector on the tiny llama (head_dim 64): the error, or its hidden states;
2. the same with the connector's CUDA stream / event / pinned copy replaced by a synchronous CPU copy
   (what the stock one would need on CPU);
3. where a step works: its hidden states vs transformers' hidden_states[i] of the same target and
   tokens (max |diff| per layer), and the time of SmolLM2-135M's features for the prompts vs the HF
   prefill draftkit computes them with today (Target.features, batches of 8, length-sorted).
Writes JSON (--out) with every error verbatim.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent('''
    import json, os, sys, time
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    req = json.loads(open(sys.argv[1]).read())
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt
    if req["patch_cpu"]:  # the connector's CUDA stream/event/pinned copy -> a synchronous CPU copy
        from safetensors.torch import save_file
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

        class Done:
            def query(self):
                return True

        def submit(self, pending):
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size)[None] + blocks[:, None] * self._block_size).flatten()
            hs = m.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": hs.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
            fd = self._lock_fds.pop(pending.req_id, None)
            if fd is not None:
                os.close(fd)
            self._req_copy_events[pending.req_id] = Done()

        m.ExampleHiddenStatesConnector._submit_async_write = submit
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req["dtype"], skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=req["max_model_len"], max_num_seqs=req["max_num_seqs"], enable_prefix_caching=False,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": req["layers"]}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": req["out_dir"]}})
    load = time.perf_counter() - t0
    t1 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]],
                        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    hs = [load_hidden_states(p) if p else None for p in paths]
    wall = time.perf_counter() - t1
    out = {"load_seconds": load, "wall_s": wall, "paths": paths,
           "shapes": [list(h["hidden_states"].shape) if h else None for h in hs]}
    open(sys.argv[2], "w").write(json.dumps(out))
''')


def tiny_llama(out: Path) -> Path:
    """The tiny llama tests/test_engine_data.py serves (head_dim 64, the test tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(ROOT / "tests" / "fixtures" / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_vllm(model: Path, dtype: str, prompts: list[list[int]], layers: list[int], patch_cpu: bool,
             work: Path, python: str) -> dict:
    """One vLLM process; {ok, error | load_seconds, wall_s, hidden: [(T, layers, H)]}."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "worker.py").write_text(WORKER)
    req = {"model": str(model), "dtype": dtype, "prompts": prompts, "layers": layers, "patch_cpu": patch_cpu,
           "out_dir": str(work / "hs"), "max_model_len": max(map(len, prompts)) + 8, "max_num_seqs": 8}
    (work / "req.json").write_text(json.dumps(req))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([python, str(work / "worker.py"), str(work / "req.json"), str(work / "res.json")],
                           capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired as e:
        out = (e.stderr or e.stdout or b"")
        lines = (out.decode() if isinstance(out, bytes) else out).strip().splitlines()
        return {"ok": False, "exit": None, "error": "no result within 300 s (hung)", "log_tail": lines[-30:],
                "process_seconds": time.perf_counter() - t0}
    if r.returncode != 0 or not (work / "res.json").is_file():
        lines = (r.stderr or r.stdout).strip().splitlines()
        err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        return {"ok": False, "exit": r.returncode, "error": err, "log_tail": lines[-30:],
                "process_seconds": time.perf_counter() - t0}
    res = json.loads((work / "res.json").read_text())
    from safetensors.torch import load_file

    hidden = [load_file(p)["hidden_states"] if p else None for p in res["paths"]]
    return {"ok": all(h is not None for h in hidden), "load_seconds": res["load_seconds"], "wall_s": res["wall_s"],
            "shapes": res["shapes"], "hidden": hidden, "process_seconds": time.perf_counter() - t0}


def hf_hidden(model_dir: Path, dtype: str, prompts: list[list[int]], layers: list[int]) -> list[torch.Tensor]:
    """transformers' hidden_states[i] per prompt: (T, layers, H); id N = the last layer's output before the norm."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            hs = m.model(input_ids=ids, output_hidden_states=True).hidden_states
            # transformers 5: hidden_states[N] is after the final norm; the residual before it is
            # captured from the last layer's output instead
            pre = {}
            h = m.model.layers[-1].register_forward_hook(lambda mod, a, o: pre.setdefault("x", o[0] if isinstance(o, tuple) else o))
            m.model(input_ids=ids)
            h.remove()
            n = len(m.model.layers)
            out.append(torch.stack([(pre["x"] if i == n else hs[i])[0] for i in layers], dim=1))
    return out


def compare(ours: list[torch.Tensor], engine: list[torch.Tensor], layers: list[int]) -> dict:
    diffs = {str(i): max(float((a[:, j].float() - b[:, j].float()).abs().max()) for a, b in zip(ours, engine))
             for j, i in enumerate(layers)}
    scale = max(float(a.float().abs().max()) for a in ours)
    return {"max_abs_diff_per_layer": diffs, "max_abs_value": scale}


def timing(python: str, prompts: list[list[int]], layers: list[int], dtype: str, work: Path,
           patch_cpu: bool) -> dict:
    """SmolLM2-135M: features of the prompts through vLLM vs draftkit's HF prefill (Target.features)."""
    from draftkit.target import embedded_model_dir, load_target

    model_dir = embedded_model_dir()
    target = load_target(str(model_dir), dtype=dtype)
    order = sorted(prompts, key=len)
    pad = target.tokenizer.pad_token_id or 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(order), 8):
            chunk = order[i:i + 8]
            w = max(map(len, chunk))
            ids = torch.tensor([p + [pad] * (w - len(p)) for p in chunk])
            mask = torch.tensor([[1] * len(p) + [0] * (w - len(p)) for p in chunk])
            target.features(ids, mask, layers=tuple(i for i in layers if i < target.num_layers))
    hf_s = time.perf_counter() - t0
    v = run_vllm(model_dir, dtype, order, layers, patch_cpu, work, python)
    tokens = sum(map(len, prompts))
    return {"prompts": len(prompts), "tokens": tokens, "hf_prefill_seconds": round(hf_s, 2),
            "hf_tok_per_s": round(tokens / hf_s, 1), "vllm": {k: v[k] for k in v if k != "hidden"},
            "vllm_tok_per_s": round(tokens / v["wall_s"], 1) if v.get("ok") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_features.json")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from draftkit.engines.vllm import find_python

    python = find_python()
    work = Path(tempfile.mkdtemp(prefix="draftkit-vllm-features-"))
    model = tiny_llama(work / "tiny")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [f"tell me about {w} and why it matters to the {v}" for w, v in
             zip("alpha beta gamma delta epsilon zeta".split(), "world city sea sky forest river".split())]
    prompts = [tok(t)["input_ids"] for t in texts]
    layers = [1, 2, 4]  # EAGLE-3-like low/mid ids and 4 = N: the last layer's output (EAGLE-1's, before the norm)
    result = {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
              "dtype": args.dtype, "layers": layers, "steps": {}}
    working = None
    for name, patch in (("stock_connector", False), ("cpu_copy_connector", True)):
        r = run_vllm(model, args.dtype, prompts, layers, patch, work / name, python)
        entry = {k: v for k, v in r.items() if k != "hidden"}
        if r.get("ok"):
            entry["vs_hf"] = compare(hf_hidden(model, args.dtype, prompts, layers), r["hidden"], layers)
            working = working if working is not None else patch
        result["steps"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "log_tail"})[:2000])
    if working is not None:
        from draftkit.distill import PromptSource, load_prompts
        from draftkit.distill.regenerate import chat_ids
        from draftkit.target import embedded_model_dir

        files = sorted((ROOT.parent / "shared" / "data" / "train").glob("*.jsonl"))
        stok = AutoTokenizer.from_pretrained(embedded_model_dir())
        ps = load_prompts([PromptSource(str(f)) for f in files], limit=args.num_prompts, seed=0)
        ids = [chat_ids(stok, p.messages, True) for p in ps]
        result["timing_smollm2"] = timing(python, ids, [2, 15, 27, 30], args.dtype, work / "timing", working)
        print("timing", json.dumps(result["timing_smollm2"])[:2000])
    from draftkit.inference.report import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
