#!/usr/bin/env python
"""Why vLLM CPU accepts less than our loop at T > 0: a trace of vLLM's rejection sampler, per step.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_t1_trace.py [--methods ngram eagle]
        [--temperatures 1 0.2 0.05] [--batch-sizes 1 4] [--max-new-tokens 32] [--k 3] [--out JSON]

Builds the tests' tiny vLLM-servable llama (tests/conftest.py: save_vllm_target), repetitive prompts
(so vLLM's ngram drafts) and a tiny EAGLE head fitted on the target's greedy continuations, exported
for vLLM. Then the vLLM venv (engines/vllm.py: find_python) runs this file with --engine-side: vLLM
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, draftkit/engines/vllm_worker.py serving), with
vllm/v1/sample/rejection_sampler.py's apply_sampling_constraints, generate_uniform_probs and
rejection_sample wrapped to record, per drafted token: the draft id, whether draft_probs is None,
the temperature requested (SamplingParams) and the one applied (raw logit / processed logit), the
target's probability of the draft under the requested temperature (p_rule) and under what vLLM
applied (p_vllm), the uniform u, and vLLM's accept decision. Each engine runs twice: as shipped,
and with the worker's cpu_sampler_fix. From the dump:

    rule     = accepted under vLLM's own uniforms with p_rule (accept x while p_rule(x) >= u)
    kernel   = accepted under vLLM's uniforms with p_vllm (what its C++ kernel should decide)
    expected = sum over drafts of prod_{j <= i} p_rule(x_j) (the rule's mean, given the drafts)

The kernel column equals vLLM's decisions (the kernel is right, benchmarks/vllm_cpu_rejection_kernel.py);
where the applied temperature is not the requested one, rule and vLLM part. Prints a table, writes
JSON (benchmarks/results/vllm_t1_trace.json). Our loop (greedy drafts, standard rejection) runs the
EAGLE head on the same prompts for its alpha_1 beside.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "draftkit" / "engines" / "vllm_worker.py"
TOKEN_SAMPLE = 4  # drafted-token records kept per run in the JSON (the summary covers all)


# ---- engine side: runs in the vLLM venv ------------------------------------------------------------

class Trace:
    """The rejection sampler's inputs and decisions, one record per drafted token."""

    def __init__(self):
        self.tokens: list[dict] = []
        self.steps: list[dict] = []
        self._raw = None
        self._uniform = None

    def install(self, rs) -> None:
        """Wrap rejection_sampler's module-level functions (RejectionSampler.forward looks them up)."""
        import torch

        constraints, uniform, sample = rs.apply_sampling_constraints, rs.generate_uniform_probs, rs.rejection_sample

        def apply_sampling_constraints(logits, cu, sm):
            raw = logits.clone()  # (num_tokens, V) the target's logits at the drafted positions
            out = constraints(logits, cu, sm)
            self._raw = raw
            return out

        def generate_uniform_probs(*args, **kwargs):
            u = uniform(*args, **kwargs)
            self._uniform = u.clone()
            return u

        def rejection_sample(draft_ids, num_draft, max_spec_len, cu, draft_probs, target_logits, bonus, sm, **kw):
            processed = target_logits.clone()
            out = sample(draft_ids, num_draft, max_spec_len, cu, draft_probs, target_logits, bonus, sm, **kw)
            if not sm.all_greedy:
                with torch.no_grad():
                    self.record(draft_ids, num_draft, draft_probs, processed, out, sm)
            return out

        rs.apply_sampling_constraints = apply_sampling_constraints
        rs.generate_uniform_probs = generate_uniform_probs
        rs.rejection_sample = rejection_sample

    def record(self, draft_ids, num_draft, draft_probs, processed, out, sm) -> None:
        import torch

        raw, u = self._raw, self._uniform
        p_vllm = processed.softmax(-1, dtype=torch.float32)  # what rejection_sample hands its kernel
        start = 0
        for r, n in enumerate(num_draft):
            t_req = float(sm.temperature[r])
            p_rule = (raw[start:start + n] / t_req).softmax(-1)  # (n, V) the target at the requested T
            accepted = int((out[r] != -1).sum()) - 1 if n else 0  # accepted drafts + 1 recovered/bonus
            for i in range(n):
                x, tok = int(draft_ids[start + i]), start + i
                if x < 0:  # a padded draft slot: vLLM rejects it
                    p_r = p_v = 0.0
                else:
                    p_r, p_v = float(p_rule[i, x]), float(p_vllm[tok, x])
                finite = torch.isfinite(processed[tok]) & (processed[tok] != 0)
                ratio = (raw[tok][finite] / processed[tok][finite]).median().item() if finite.any() else float("nan")
                self.tokens.append({"step": len(self.steps), "request": r, "pos": i, "draft": x,
                                    "draft_probs_none": draft_probs is None, "t_requested": t_req,
                                    "t_applied": ratio, "p_rule": p_r, "p_vllm": p_v,
                                    "u": float(u[tok]), "accepted": i < accepted,
                                    "top_k_set": sm.top_k is not None, "top_p_set": sm.top_p is not None})
            if n:
                self.steps.append({"n": n, "accepted": accepted})
            start += n

    def take(self) -> tuple[list[dict], list[dict]]:
        tokens, steps, self.tokens, self.steps = self.tokens, self.steps, [], []
        return tokens, steps


def summarize(tokens: list[dict], steps: list[dict], k: int) -> dict:
    """Per position: vLLM's accepted drafts, the rule's (vLLM's u, p_rule), the kernel's (vLLM's u,
    p_vllm), the rule's expectation; and what temperature was applied."""
    vllm_acc, rule_acc, kern_acc, expected = [0] * k, [0] * k, [0] * k, [0.0] * k
    by_step: dict[tuple, list[dict]] = {}
    for t in tokens:
        by_step.setdefault((t["step"], t["request"]), []).append(t)
    for toks in by_step.values():
        toks.sort(key=lambda t: t["pos"])
        ok_rule = ok_kern = ok_vllm = True
        prod = 1.0
        for t in toks:
            ok_vllm &= t["accepted"]
            ok_rule &= t["p_rule"] >= t["u"]
            ok_kern &= t["p_vllm"] >= t["u"]
            prod *= t["p_rule"]
            i = t["pos"]
            vllm_acc[i] += ok_vllm
            rule_acc[i] += ok_rule
            kern_acc[i] += ok_kern
            expected[i] += prod
    applied = [t["t_applied"] for t in tokens]
    same_t = sum(abs(t["t_applied"] - t["t_requested"]) <= 1e-3 * t["t_requested"] for t in tokens)
    kernel_agrees = sum(
        (t["p_vllm"] >= t["u"]) == t["accepted"] for t in tokens
        if all(s["accepted"] for s in by_step[(t["step"], t["request"])] if s["pos"] < t["pos"]))
    reached = sum(all(s["accepted"] for s in by_step[(t["step"], t["request"])] if s["pos"] < t["pos"]) for t in tokens)
    return {"drafts": len(by_step), "drafted_tokens": len(tokens),
            "accepted_per_pos": {"vllm": vllm_acc, "rule": rule_acc, "kernel": kern_acc,
                                 "expected": [round(e, 3) for e in expected]},
            "alpha_1": {m: (v[0] / len(by_step) if by_step else None)
                        for m, v in (("vllm", vllm_acc), ("rule", rule_acc), ("kernel", kern_acc), ("expected", expected))},
            "draft_probs_none": all(t["draft_probs_none"] for t in tokens),
            "top_k_or_top_p_set": any(t["top_k_set"] or t["top_p_set"] for t in tokens),
            "t_requested": sorted({t["t_requested"] for t in tokens}),
            "t_applied_equals_requested": f"{same_t} of {len(tokens)}",
            "t_applied_examples": [f"{a:.3g}" for a in applied[:6]],
            "mean_p_rule": sum(t["p_rule"] for t in tokens) / len(tokens) if tokens else None,
            "mean_p_vllm": sum(t["p_vllm"] for t in tokens) / len(tokens) if tokens else None,
            "kernel_matches_vllm_decisions": f"{kernel_agrees} of {reached} reached tokens",
            "token_sample": tokens[:TOKEN_SAMPLE]}


def engine_side(request_path: str, result_path: str) -> int:
    """vllm_worker.main with the trace installed; each run's result gains `trace`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    spec = importlib.util.spec_from_file_location("draftkit_vllm_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    import vllm.v1.sample.rejection_sampler as rs

    trace, k = Trace(), json.loads(Path(request_path).read_text())["k"]
    trace.install(rs)
    run_one = worker.run_one

    def traced(llm, prompts, run):
        res = run_one(llm, prompts, run)
        res["trace"] = summarize(*trace.take(), k)
        return res

    worker.run_one = traced
    return worker.main(request_path, result_path)


# ---- draftkit side ----------------------------------------------------------------------------------

def build_world(work: Path, n_prompts: int, new_tokens: int) -> dict:
    """The tests' tiny target, repetitive prompts (a 4-token motif x4) and a fitted EAGLE head, exported."""
    import torch

    from draftkit.export import export_head
    from draftkit.heads import build_head
    from tests.conftest import fit_on_greedy_continuations, save_vllm_target

    target = save_vllm_target(work / "target")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (4,), generator=g).tolist() * 4 for _ in range(n_prompts)]
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, target)
    fit_on_greedy_continuations(target, head, steps=150, prompts=prompts, new_tokens=new_tokens, length=None)
    head.eval().save_pretrained(work / "eagle")
    export = export_head(work / "eagle", "vllm", work / "eagle-vllm", target=target)
    return {"target": target, "prompts": prompts, "head": head, "export": export}


def loop_alpha(world, k: int, temperature: float, max_new: int) -> dict:
    """Our chain under vLLM's rule (greedy drafts, standard rejection), prompt i seeded 0 + i."""
    from draftkit.engines.vllm import loop_figures
    from draftkit.engines.vllm_eval import loop_decoder
    from draftkit.inference.sampling import SamplingParams

    dec = loop_decoder(world["target"], world["head"], k, [])
    _, stats = dec.generate(world["prompts"], max_new, SamplingParams(temperature=temperature),
                            seeds=list(range(len(world["prompts"]))))
    return loop_figures(stats)


def serve_traced(world, work: Path, args, fix: bool) -> dict:
    """One vLLM process: ngram and/or the EAGLE export, each run traced (engine_side)."""
    from draftkit.engines.vllm import EngineRequest, EngineRun, Sampling, find_python, speculative_config

    runs = [EngineRun(f"T={t:g} B={b}", Sampling(temperature=t, seed=0, max_tokens=args.max_new_tokens,
                                                 ignore_eos=True), b)
            for t in args.temperatures for b in args.batch_sizes]
    # ngram last: its proposer imports numba, and a later engine's start in the same process then fails
    # in vLLM's kernel registration (triton_utils/dispatcher.py:139 reads vars() of llvmlite's wrappers)
    methods = sorted(args.methods, key=lambda m: m == "ngram")
    engines = [{"name": m, "speculative_config": speculative_config(m, args.k, world["export"])} for m in methods]
    req = EngineRequest(str(work / "target"), world["prompts"], runs, engines=engines)
    body = {**req.to_json(), "cpu_sampler_fix": fix, "k": args.k}
    (work / "request.json").write_text(json.dumps(body))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)  # the engine side imports vLLM's environment only
    r = subprocess.run([find_python(), __file__, "--engine-side", str(work / "request.json"), str(work / "result.json")],
                       env=env, capture_output=True, text=True)
    (work / f"engine-fix{int(fix)}.log").write_text(r.stderr)
    if r.returncode:
        sys.exit(f"vLLM failed (log: {work / f'engine-fix{int(fix)}.log'}):\n{r.stderr[-3000:]}")
    return json.loads((work / "result.json").read_text())


def table(rows: list[dict]) -> str:
    head = (f"{'method':<6} {'sampler':<12} {'run':<9} {'drafts':>6} {'T applied = requested':>22} "
            f"{'mean p_rule':>11} {'mean p_vllm':>11}  alpha_1: vllm / kernel / rule / expected / counters")
    lines = [head]
    for r in rows:
        t, a = r["trace"], r["trace"]["alpha_1"]
        f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        c = r["counters"]
        counters = c["accepted_per_pos"][0] / c["num_drafts"] if c["num_drafts"] and c["accepted_per_pos"] else None
        lines.append(f"{r['method']:<6} {r['sampler']:<12} {r['run']:<9} {t['drafts']:>6} "
                     f"{t['t_applied_equals_requested']:>22} {f(t['mean_p_rule']):>11} {f(t['mean_p_vllm']):>11}  "
                     f"{f(a['vllm'])} / {f(a['kernel'])} / {f(a['rule'])} / {f(a['expected'])} / {f(counters)}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--engine-side":
        return engine_side(sys.argv[2], sys.argv[3])
    sys.path.insert(0, str(ROOT))
    from benchmarks.engine_vllm import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["ngram", "eagle"], choices=["ngram", "eagle"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.2, 0.05])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vllm_t1_trace.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="draftkit-t1-trace-"))
    world = build_world(work, args.prompts, args.max_new_tokens)
    rows, result = [], {"cpu_flags": cpu_flags(), "args": {k: str(v) for k, v in vars(args).items()}}
    for fix in (False, True):
        res = serve_traced(world, work, args, fix)
        result["vllm_version"] = res["vllm_version"]
        for e in res["engines"]:
            sampler = {"applied": "fixed", "off": "as shipped"}.get(e["cpu_sampler_fix"], e["cpu_sampler_fix"])
            for run in e["runs"]:
                rows.append({"method": e["name"], "sampler": sampler, "run": run["name"], "trace": run["trace"],
                             "counters": run["counters"]})
    if "eagle" in args.methods:
        result["loop_eagle"] = {f"T={t:g}": loop_alpha(world, args.k, t, args.max_new_tokens) for t in args.temperatures}
    result["rows"] = rows
    print(f"vLLM {result['vllm_version']}, tiny llama (tests/conftest.py), {len(world['prompts'])} repetitive prompts, "
          f"{args.max_new_tokens} new tokens, k={args.k}, CPU {result['cpu_flags']}")
    print(table(rows))
    for name, lf in result.get("loop_eagle", {}).items():
        print(f"our loop, eagle, {name}: drafts {lf['drafts']}, alpha_1 {lf['alpha'][0]:.3f}, "
              f"accepted per position {lf['accepted_per_pos']}")
    from draftkit.inference.report import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
