"""Where vLLM's CPU step time goes: a plain decoding step vs an EAGLE chain step, broken down by vLLM function.

    python benchmarks/vllm_step_profile.py [--head runs/quick/head] [--limit 4] [--max-new-tokens 64] [--k 3]
        [--dtype float32] [--torch-profile-steps 24]

Embedded target (SmolLM2-135M, the safetensors directory draftkit converts it into: the export's
verifier), Spec-Bench dev prompts, T = 0, batch 1. The head is exported to vLLM's layout as
`draftkit eval --engine vllm` does (engines/vllm_eval.py: prepare_export). Each method runs in its own
vLLM process (vLLM's environment, engines/vllm.py: find_python) with VLLM_ENABLE_V1_MULTIPROCESSING=0,
so the engine core, scheduler and model runner run in that process; this script, loaded there as
`--child`, wraps vLLM's step functions (LLMEngine.step, EngineCore.step, Scheduler.schedule, the model
runner's execute_model / _prepare_inputs / _model_forward / sample_tokens / _sample, the rejection
sampler, the EAGLE proposer, the target's and the drafter's forward and compute_logits, the CPU
attention and its metadata builder) with timers. Each timer is keyed by its call path, so a row's
time is inclusive and "(self)" rows are what a function spends outside the timed functions it calls.
Steps that admit a new request (prefill) are left out; the figures are means per decode step.
With --torch-profile-steps N, torch.profiler also records N decode steps of each method (the
operators with the most self CPU time; the profiler's own overhead inflates small ops).

Prints a table and writes benchmarks/results/vllm_step_profile.json (--out) with the CPU flags.
Timed figures only from a run alone on the machine (../shared/bin/one-at-a-time).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "draftkit" / "engines" / "vllm_worker.py"

# (module, class, method, key by the instance's class instead of the defining one)
TIMED = [
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step", False),
    ("vllm.v1.engine.core", "EngineCore", "step", False),
    ("vllm.v1.engine.core", "EngineCore", "post_step", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_calc_spec_decode_metadata", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids", False),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync", False),
    ("vllm.v1.sample.sampler", "Sampler", "forward", False),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward", False),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "propose", False),
    ("vllm.model_executor.models.llama", "LlamaForCausalLM", "forward", True),
    ("vllm.model_executor.models.llama", "LlamaForCausalLM", "compute_logits", True),
    ("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM", "forward", True),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward", False),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder", "build", False),
]


# ---- inside vLLM's process (--child): imports nothing of draftkit --------------------------------

class StepTimers:
    """Inclusive seconds and calls per call path, per LLMEngine.step; a step admitting a new request is a prefill."""

    def __init__(self):
        self.stack: list[str] = []
        self.step: dict | None = None
        self.steps: list[dict] = []
        self.recording = False

    def install(self) -> None:
        import importlib

        for module, cls_name, method, by_instance in TIMED:
            try:
                cls = getattr(importlib.import_module(module), cls_name)
            except (ImportError, AttributeError) as e:
                print(f"vllm_step_profile: not timed: {module}.{cls_name}.{method} ({e})", file=sys.stderr)
                continue
            if method in vars(cls):
                setattr(cls, method, self.timed(vars(cls)[method], cls_name, method, by_instance))

    def timed(self, fn, cls_name: str, method: str, by_instance: bool):
        timers = self

        def wrapper(obj, *args, **kwargs):
            label = f"{type(obj).__name__ if by_instance else cls_name}.{method}"
            top = label == "LLMEngine.step"
            if top:
                timers.step = {"prefill": False, "parts": {}, "calls": {}}
            timers.stack.append(label)
            path = "/".join(timers.stack)
            t0 = time.perf_counter()
            try:
                out = fn(obj, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                timers.stack.pop()
                if timers.step is not None:
                    timers.step["parts"][path] = timers.step["parts"].get(path, 0.0) + dt
                    timers.step["calls"][path] = timers.step["calls"].get(path, 0) + 1
            if label == "Scheduler.schedule" and timers.step is not None and getattr(out, "scheduled_new_reqs", None):
                timers.step["prefill"] = True
            if top:
                if timers.recording and timers.step["parts"]:
                    timers.steps.append(timers.step)
                timers.step = None
            return out

        return wrapper


def load_worker():
    """draftkit's vllm_worker.py (its counters), loaded by path: its directory would shadow vllm."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draftkit_vllm_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child(request_path: str, result_path: str) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    req = json.loads(Path(request_path).read_text())
    worker = load_worker()
    timers = StepTimers()
    timers.install()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=req["model"], dtype=req["dtype"], enforce_eager=True, skip_tokenizer_init=True,
              speculative_config=req["speculative_config"], max_model_len=req["max_model_len"], max_num_seqs=1,
              disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                            stop_token_ids=req["stop_token_ids"] or None)
    llm.generate([TokensPrompt(prompt_token_ids=req["prompts"][0])], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up, not recorded
    before, timers.recording, outputs = worker.counters(llm), True, []
    t0 = time.perf_counter()
    for p in req["prompts"]:  # batch 1
        outputs += [list(o.outputs[0].token_ids) for o in
                    llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)]
    wall = time.perf_counter() - t0
    timers.recording = False
    result = {"wall_s": wall, "new_tokens": sum(map(len, outputs)), "steps": timers.steps,
              "counters": worker.delta(worker.counters(llm), before), "torch_profile": None}
    if req["torch_profile_steps"]:
        result["torch_profile"] = torch_profile(llm, req, TokensPrompt, SamplingParams)
    Path(result_path).write_text(json.dumps(result))
    return 0


def torch_profile(llm, req: dict, TokensPrompt, SamplingParams) -> dict:
    """Operators with the most self CPU time over ~N decode steps of one prompt (ignore_eos)."""
    import torch

    n = req["torch_profile_steps"]
    params = SamplingParams(temperature=0.0, max_tokens=n * (req["k"] + 1 if req["speculative_config"] else 1),
                            ignore_eos=True, detokenize=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([TokensPrompt(prompt_token_ids=req["prompts"][0])], params, use_tqdm=False)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return {"total_self_cpu_ms": total / 1e3,
            "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]}


# ---- in draftkit's environment --------------------------------------------------------------------

def run_child(python: str, request: dict, timeout: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="draftkit-vllm-profile-"))
    (work / "req.json").write_text(json.dumps(request))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([python, __file__, "--child", str(work / "req.json"), str(work / "out.json")],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0 or not (work / "out.json").is_file():
        sys.exit(f"vLLM failed ({request['name']}, exit {r.returncode}):\n" + "\n".join(r.stderr.splitlines()[-30:]))
    return json.loads((work / "out.json").read_text())


def summarize(res: dict, n_prompts: int) -> dict:
    """Mean seconds per decode step per call path (inclusive), calls per step, tokens per step."""
    decode = [s for s in res["steps"] if not s["prefill"]]
    n = max(len(decode), 1)
    paths = sorted({p for s in decode for p in s["parts"]})
    parts = {p: sum(s["parts"].get(p, 0.0) for s in decode) / n for p in paths}
    calls = {p: sum(s["calls"].get(p, 0) for s in decode) / n for p in paths}
    totals = [s["parts"]["LLMEngine.step"] for s in decode]
    tokens = res["new_tokens"] - n_prompts  # each prompt's first token comes from its prefill step
    return {"decode_steps": len(decode), "prefill_steps": len(res["steps"]) - len(decode),
            "ms_per_step_mean": 1e3 * statistics.mean(totals), "ms_per_step_median": 1e3 * statistics.median(totals),
            "tokens_per_step": tokens / n, "ms_per_token": 1e3 * sum(totals) / max(tokens, 1),
            "tokens_per_s_overall": res["new_tokens"] / res["wall_s"], "parts_ms": {p: 1e3 * v for p, v in parts.items()},
            "calls_per_step": calls, "counters": res["counters"], "torch_profile": res["torch_profile"]}


def self_times(parts: dict) -> dict:
    """path -> inclusive minus its timed children (for paths that have children)."""
    out = {}
    for p, v in parts.items():
        kids = [q for q in parts if q.startswith(p + "/") and q.count("/") == p.count("/") + 1]
        if kids:
            out[p] = v - sum(parts[q] for q in kids)
    return out


def table(summaries: dict) -> str:
    names = list(summaries)
    lines = [f"{'ms per decode step (inclusive)':<62}" + "".join(f"{n:>22}" for n in names)]
    for key in ("ms_per_step_mean", "ms_per_step_median", "tokens_per_step", "ms_per_token"):
        lines.append(f"{key:<62}" + "".join(f"{summaries[n][key]:>22.2f}" for n in names))
    rows = sorted({p for s in summaries.values() for p in s["parts_ms"]})
    selfs = {n: self_times(s["parts_ms"]) for n, s in summaries.items()}
    for p in rows:
        depth, leaf = p.count("/"), p.split("/")[-1]
        cells = []
        for n in names:
            s = summaries[n]
            v, c = s["parts_ms"].get(p), s["calls_per_step"].get(p)
            cells.append(f"{v:>13.2f} ({c:>4.1f}x)" if v is not None else f"{'-':>22}")
        lines.append(f"{'  ' * depth + leaf:<62}" + "".join(cells))
        if any(p in selfs[n] for n in names):
            cells = [f"{selfs[n][p]:>22.2f}" if p in selfs[n] else f"{'-':>22}" for n in names]
            lines.append(f"{'  ' * (depth + 1) + '(self)':<62}" + "".join(cells))
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from draftkit.engines.vllm import engine_figures, find_python, speculative_config
    from draftkit.engines.vllm_eval import prepare_export
    from draftkit.inference.decoder import stop_token_ids
    from draftkit.inference.evaluate import encode, read_prompt_file
    from draftkit.target import cpu_flags, load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=str(ROOT / "runs/quick/head"), help="a native head or a vLLM export")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/results/specbench_dev60.jsonl"))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--torch-profile-steps", type=int, default=24, help="0: no torch.profiler pass")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vllm_step_profile.json")
    args = ap.parse_args()
    python = find_python()
    target = load_target(None, dtype=args.dtype)
    work = Path(tempfile.mkdtemp(prefix="draftkit-vllm-profile-export-"))
    export, contract, notes = prepare_export(Path(args.head), target, work)
    ids = [i for i in (encode(target.tokenizer, p) for p in read_prompt_file(args.prompts)[: args.limit]) if i]
    base = {"model": contract["verifier"]["name_or_path"], "dtype": args.dtype, "prompts": ids, "k": args.k,
            "max_tokens": args.max_new_tokens, "stop_token_ids": stop_token_ids(target),
            "max_model_len": max(map(len, ids)) + args.max_new_tokens + 16 + args.k,
            "torch_profile_steps": args.torch_profile_steps}
    methods = {"plain": None, f"eagle k={args.k}": speculative_config(contract["family"], args.k, export)}
    summaries = {}
    for name, spec in methods.items():
        res = run_child(python, {**base, "name": name, "speculative_config": spec}, args.timeout)
        summaries[name] = summarize(res, len(ids))
        if spec:
            summaries[name]["engine"] = engine_figures(res["counters"], args.k)
    flags = cpu_flags()
    print(f"vLLM CPU step profile: embedded target, {args.dtype}, batch 1, {len(ids)} prompts, "
          f"{args.max_new_tokens} new tokens, head {args.head}, CPU {flags}, {os.cpu_count()} cores")
    for n in notes:
        print(f"note: {n}")
    print(table(summaries))
    for name, s in summaries.items():
        if s["torch_profile"]:
            tp = s["torch_profile"]
            print(f"\ntorch.profiler, {name}: top ops by self CPU time (of {tp['total_self_cpu_ms']:.0f} ms)")
            for op in tp["top_ops"][:12]:
                print(f"  {op['op']:<48} {op['self_cpu_ms']:>10.1f} ms {op['calls']:>7} calls")
    out = {"cpu_flags": flags, "args": {k: str(v) for k, v in vars(args).items()}, "notes": notes,
           "num_prompts": len(ids), "methods": summaries}
    from draftkit.inference.report import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from rerunning this
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3]))
    sys.exit(main())
