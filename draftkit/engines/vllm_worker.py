"""The process that runs vLLM: JSON request in, JSON result out. Runs in vLLM's own environment.

    python vllm_worker.py REQUEST.json RESULT.json

It imports nothing of draftkit (vLLM's environment need not have it) and is started by
draftkit/engines/vllm.py, which builds the request and reads the result. One request = one engine
(one speculative config) and a list of runs over the same prompts, or with `engines` several
engines one after another in this one process (each built, run and shut down in turn):

  request {model, dtype, speculative_config | null, max_model_len, max_num_seqs, kv_cache_gib,
           prompts: [[token id]], runs: [{name, batch_size, sampling: {temperature, top_p, top_k,
           seed, max_tokens, ignore_eos}}], inspect_drafter: bool, cpu_sampler_fix: bool}
  result  {vllm_version, load_seconds, runs: [{name, outputs: [[token id]], wall_s, new_tokens,
           tokens_per_s, counters: {num_drafts, num_draft_tokens, num_accepted_tokens,
           accepted_per_pos}}], drafter: {...} | null, cpu_sampler_fix: applied | not needed | not cpu | off}

cpu_sampler_fix: vLLM CPU 0.32.0's rejection sampler applies an uninitialised temperature at T > 0
(fix_cpu_rejection_sampler's doc); with it set, the worker probes for that defect after the engine
starts and, where found, serves with the temperature applied as vLLM's rule states.
  request with engines: [{name, speculative_config | null, drafter_files (optional: this engine's
           files for inspect_drafter)}] -> result {vllm_version,
           engines: [{name, speculative_config, load_seconds, runs: [...], drafter}]}

Counters are vLLM's own (llm.get_metrics(): vllm:spec_decode_*), taken as the difference across
each run. A run of batch_size B hands vLLM B prompts at a time (max_num_seqs = the largest B).
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so inspect_drafter can
read the drafter's parameters as vLLM loaded them.
"""
from __future__ import annotations

import json
import os
import sys
import time

# This file's directory holds draftkit's vllm.py, which must not shadow the vllm package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (zeros when the engine does not speculate)."""
    out = {v: 0 for v in COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = list(m.values)
            acc = out["accepted_per_pos"] + [0] * (len(vals) - len(out["accepted_per_pos"]))
            out["accepted_per_pos"] = [a + int(v) for a, v in zip(acc, vals + [0] * (len(acc) - len(vals)))]
    return out


def delta(after: dict, before: dict) -> dict:
    per = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
           for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in COUNTERS.values()}, "accepted_per_pos": per}


def run_one(llm, prompts: list, run: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    s = run["sampling"]
    seed = s.get("seed")

    def params(i: int) -> SamplingParams:  # prompt i samples with seed + i, as draftkit's loop
        return SamplingParams(temperature=s["temperature"], top_p=s.get("top_p", 1.0), top_k=s.get("top_k") or 0,
                              seed=None if seed is None else seed + i, max_tokens=s["max_tokens"],
                              ignore_eos=s.get("ignore_eos", False), detokenize=False,
                              stop_token_ids=s.get("stop_token_ids") or None)

    before, outputs = counters(llm), []
    t0 = time.perf_counter()
    B = run["batch_size"]
    for i in range(0, len(prompts), B):
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + B]]
        outs = llm.generate(chunk, [params(j) for j in range(i, i + len(chunk))], use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    wall = time.perf_counter() - t0
    new = sum(len(o) for o in outputs)
    return {"name": run["name"], "outputs": outputs, "wall_s": wall, "new_tokens": new,
            "tokens_per_s": new / wall if wall else 0.0, "counters": delta(counters(llm), before)}


SNAPSHOTS: dict = {}  # id(model) -> {parameter name: values as loaded, before CPU repacking}


def snapshot_loaded_weights() -> None:
    """vLLM's CPU linear layers repack their weights after loading (the parameter is left empty):
    keep a copy of every model's parameters as loaded, for inspect_drafter."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def wrapped(model, *args, **kwargs):
        SNAPSHOTS[id(model)] = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        return original(model, *args, **kwargs)

    base_loader.process_weights_after_loading = wrapped


def _values(model) -> dict:
    """A model's parameters as served: the current value, or the loaded one where repacking emptied it."""
    snap = SNAPSHOTS.get(id(model), {})
    return {n: (p.detach().float().cpu() if p.numel() or n not in snap else snap[n])
            for n, p in model.named_parameters()}


def _row_blocks(p, file: dict) -> tuple[list, int, list]:
    """The file tensors found as row blocks of p (vLLM stacks q/k/v and gate/up along dim 0)."""
    import torch

    covered, pieces = torch.zeros(p.shape[0], dtype=torch.bool), []
    for fname, t in file.items():
        if t.dim() != p.dim() or t.shape[1:] != p.shape[1:] or t.shape[0] > p.shape[0]:
            continue
        step = t.shape[0] if p.dim() > 1 else max(1, t.shape[0])
        for o in range(0, p.shape[0] - t.shape[0] + 1, step):
            if not covered[o:o + t.shape[0]].any() and torch.equal(p[o:o + t.shape[0]], t):
                covered[o:o + t.shape[0]] = True
                pieces.append([fname, o])
                break
    return pieces, int(covered.sum()), [n for n, _ in pieces]


def inspect_drafter(llm, files: list[str]) -> dict:
    """Where each drafter parameter's values came from: row blocks of the file's tensors, a target
    parameter (shared embed_tokens / lm_head), or nowhere (left at its initial value)."""
    def read(worker):
        import torch
        from safetensors.torch import load_file

        runner = worker.model_runner
        drafter = getattr(runner.drafter, "model", None)
        file = {}
        for f in files:
            file.update({k: v.float() for k, v in load_file(f).items()})
        target = _values(runner.model)
        report, used = {}, {k: [] for k in file}
        for name, p in _values(drafter).items():
            pieces, rows, names = _row_blocks(p, file)
            for n in names:
                used[n].append(name)
            same = [tn for tn, tp in target.items() if tp.shape == p.shape and torch.equal(tp, p)]
            report[name] = {"shape": list(p.shape), "from_file": pieces, "rows_covered": rows,
                            "equals_target": same}
        return {"class": type(drafter).__name__, "params": report, "file_tensors_used": used}

    return llm.collective_rpc(read)[0]


# ---- request kind "responses": data generation (draftkit/engines/vllm_data.py) ------------------

def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def generate_responses(req: dict, result_path: str) -> int:
    """kind "responses": {model, dtype, llm_kwargs, max_model_len, max_num_seqs, seed, prompts: [[id]],
    seeds: [int] (one per prompt), sampling: {temperature, top_p, max_tokens, stop_token_ids},
    chunk_size, out_dir}. Prompts go to vLLM chunk_size at a time; each finished chunk is written
    at once, atomically, as out_dir/chunk-NNNNN.json {indices, outputs: [[token id]]} (the parent
    caches it while this runs). Stops when the parent process is gone."""
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    parent, s = os.getppid(), req["sampling"]
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req["dtype"], skip_tokenizer_init=True, max_model_len=req["max_model_len"],
              max_num_seqs=req["max_num_seqs"], seed=req.get("seed", 0),
              **{"enforce_eager": True, **req.get("llm_kwargs", {})})
    load, t1, new = time.perf_counter() - t0, time.perf_counter(), 0
    prompts, C = req["prompts"], req["chunk_size"]
    for n, start in enumerate(range(0, len(prompts), C)):
        if os.getppid() != parent:
            return 3
        idx = list(range(start, min(start + C, len(prompts))))
        params = [SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=0, seed=req["seeds"][i],
                                 max_tokens=s["max_tokens"], stop_token_ids=s["stop_token_ids"] or None,
                                 detokenize=False) for i in idx]
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in idx], params, use_tqdm=False)
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        new += sum(map(len, outputs))
        write_json_atomic(os.path.join(req["out_dir"], f"chunk-{n:05d}.json"), {"indices": idx, "outputs": outputs})
    wall = time.perf_counter() - t1
    write_json_atomic(result_path, {"vllm_version": vllm.__version__, "load_seconds": load, "wall_s": wall,
                                    "new_tokens": new, "tokens_per_s": new / wall if wall else 0.0})
    return 0


# ---- vLLM CPU 0.32.0's rejection sampler at T > 0 (benchmarks/vllm_t1_trace.py measured it) ----------

def _expand_torch(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """rejection_sampler.expand_batch_to_tokens's stated rule in torch: x[b] (replace_from -> replace_to)
    repeated for each of request b's tokens, cu_num_tokens being their cumulative counts."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # (B,)
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def cpu_expand_drops_output() -> bool:
    """Whether the dispatched expand kernel leaves a float output unwritten. vLLM CPU 0.32.0's wrapper
    (vllm/utils/cpu_triton_utils.py:390, _expand_kernel_impl) hands the C++ kernel `output.to(int64)`,
    a copy for any other dtype, and never copies it back, so expand_batch_to_tokens returns the
    torch.empty it allocated: the temperature (and top_k, top_p) its rejection sampler applies to the
    target's logits at T > 0 (rejection_sampler.py:550-578) is uninitialised memory."""
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    out = torch.full((2,), float("nan"))
    rs._expand(out, torch.tensor([2.0, 0.0]), torch.tensor([1, 2], dtype=torch.int32), 0, 1)
    return out.tolist() != [2.0, 1.0]


def fix_cpu_rejection_sampler() -> str:
    """Where the probe shows the defect (vLLM's CPU platform only), serve the rejection sampler with
    expand_batch_to_tokens computed in torch, so T > 0 follows vLLM's rule as its GPU kernel applies
    it. Returns what was done: "applied", "not needed" (no defect) or "not cpu"."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not cpu"
    if not cpu_expand_drops_output():
        return "not needed"
    import vllm.v1.sample.rejection_sampler as rs

    rs.expand_batch_to_tokens = _expand_torch
    return "applied"


def serve_engine(LLM, req: dict, speculative_config: dict | None, last: bool,
                 drafter_files: list | None = None) -> dict:
    """One engine: built, every run of the request, then (unless it is the last) shut down, so
    that the next engine of request kind "engines" starts clean in this process. inspect_drafter
    reads `drafter_files` (default: the request's) and skips an engine without a drafter."""
    import gc

    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req["dtype"], enforce_eager=True, skip_tokenizer_init=True,
              speculative_config=speculative_config, max_model_len=req["max_model_len"],
              max_num_seqs=req["max_num_seqs"], disable_log_stats=False, seed=req.get("seed", 0))
    load = time.perf_counter() - t0
    fix = fix_cpu_rejection_sampler() if req.get("cpu_sampler_fix") else "off"  # after LLM(): kernels registered
    runs = [run_one(llm, req["prompts"], r) for r in req["runs"]]
    inspect = req.get("inspect_drafter") and speculative_config is not None
    files = req["drafter_files"] if drafter_files is None else drafter_files
    drafter = inspect_drafter(llm, files) if inspect else None
    if not last:
        llm.llm_engine.engine_core.shutdown()  # in-process core: frees the KV cache, tears down torch.distributed
        del llm
        gc.collect()
    return {"load_seconds": load, "runs": runs, "drafter": drafter, "cpu_sampler_fix": fix}


def main(request_path: str, result_path: str) -> int:
    req = json.loads(open(request_path).read())
    if req.get("kind") == "responses":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gib", 2)))
        return generate_responses(req, result_path)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gib", 2)))
    import vllm
    from vllm import LLM

    if req.get("inspect_drafter"):
        snapshot_loaded_weights()

    if req.get("engines"):  # one engine after another in this process (the imports paid once)
        engines = [{"name": e["name"], "speculative_config": e.get("speculative_config"),
                    **serve_engine(LLM, req, e.get("speculative_config"), last=i == len(req["engines"]) - 1,
                                   drafter_files=e.get("drafter_files"))}
                   for i, e in enumerate(req["engines"])]
        result = {"vllm_version": vllm.__version__, "engines": engines}
    else:
        one = serve_engine(LLM, req, req.get("speculative_config"), last=True)
        drafter = one.pop("drafter")
        result = {"vllm_version": vllm.__version__, **one, "drafter": drafter}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from rerunning this
    sys.exit(main(sys.argv[1], sys.argv[2]))
