"""`draftkit eval --engine vllm`: the head served by vLLM, vLLM's own figures beside vLLM plain, vLLM's
ngram and draftkit's loop under vLLM's drafting rule, on the same prompts and sampling.

    report = engine_eval(target, head_dir, prompt_ids, EngineEvalSettings(k=3, temperatures=(0.0,)))

The head directory is a native head (exported here to vLLM's layout; an EAGLE-1 head with a draft
vocabulary is exported drafting over the full vocabulary, as vLLM's llama_eagle.py does, and the
report says so) or a vLLM export. Either way draftkit's loop runs the head vLLM serves: the export
imported back. Per temperature and position the report sets our alpha_i beside the engine's, with
the difference and its tolerance (engines/vllm.py: compare); `failures` lists every one outside.
"""
from __future__ import annotations

import inspect
import sys
import json
import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftkit.engines.vllm import (EngineRequest, EngineRun, EngineUnavailable, Sampling, compare, engine_figures,
                                   find_suffix_python, loop_figures, serve, speculative_config)
from draftkit.engines.vllm_auto import DEFAULT_KS

log = logging.getLogger(__name__)
METHODS = ("plain", "ngram", "suffix", "head")  # suffix: served where arctic-inference imports, else a note


@dataclass
class EngineEvalSettings:
    k: int = 3  # num_speculative_tokens (Medusa: its number of heads)
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1,)  # one run per (temperature, batch size): "T=0 B=4"
    # our loop's batch sizes (None: batch_sizes). An engine run with no loop run of its batch size is
    # compared with the loop's run at the same temperature and the smallest batch size: our loop's
    # tokens do not depend on how prompts are batched (tests/test_spec_decoder.py's ragged batches).
    loop_batch_sizes: tuple[int, ...] | None = None
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    methods: tuple[str, ...] = METHODS
    ngram: tuple[int, int] = (1, 3)  # vLLM ngram's prompt_lookup_min, _max
    ignore_eos: bool = False  # False: stop at the target's stop ids, in vLLM as in our loop
    python: str | None = None  # the Python with vLLM (engines/vllm.py: find_python)
    model_dir: str | None = None  # the target's safetensors directory vLLM loads (default: the export's verifier)
    loop: bool = True  # also run draftkit's loop under the engine rule and compare
    work_dir: str | None = None  # where the export goes (default: a temp dir)
    timeout_s: float | None = None
    inspect_drafter: bool = False  # also report where vLLM's drafter took every parameter from
    # T > 0: serve with the worker's correction of vLLM CPU 0.32.0's rejection sampler, which applies an
    # uninitialised temperature (vllm_worker.py: fix_cpu_rejection_sampler); False: vLLM CPU as shipped
    cpu_sampler_fix: bool = True


def loop_decoder(target, head, k: int, stop_ids: list[int]):
    """draftkit's chain of k under vLLM's rule: greedy drafts (draft_sampling="greedy", where the
    loop has it; at T = 0 every rule drafts the argmax), standard rejection sampling. A DFlash head
    drafts vLLM's block of 1 + k slots (sets head.engine_block; the trained block when k = B - 1).
    On a target whose sliding window vLLM puts on the drafter, the head attends within it as the
    served drafter does (sets head.attention_window: export/vllm.py, draft_window)."""
    from draftkit.export.vllm import draft_window
    from draftkit.inference.decoder import SpecDecoder

    if hasattr(head, "engine_block"):
        head.engine_block = True
    head.attention_window = draft_window(getattr(target, "config", None))
    kw = {"draft_sampling": "greedy"} if "draft_sampling" in inspect.signature(SpecDecoder).parameters else {}
    dec = SpecDecoder(target, head, k=k, stop_ids=stop_ids, **kw)
    dec.engine_rule = bool(kw)  # False: this loop samples its drafts; only T = 0 is the engine's rule
    return dec


def prepare_export(head_dir: Path, target, work: Path) -> tuple[Path, dict, list[str]]:
    """(vLLM export dir, its contract, notes): head_dir itself when it is a vLLM export, else exported."""
    from draftkit.export import export_head
    from draftkit.export.files import find_contract, read_dir

    cfg, _ = read_dir(head_dir)
    contract = find_contract(head_dir, cfg) or {}
    notes = []
    if contract.get("format") == "vllm":
        return head_dir, contract, notes
    if contract.get("format") not in (None, "draftkit") and "family" not in cfg:
        raise ValueError(f"{head_dir}: a {contract.get('format')} export; pass the native head or a vLLM export")
    out = export_head(head_dir, "vllm", work / "vllm-export", target=target, overwrite=True, full_vocab=True)
    contract = json.loads((out / "config.json").read_text())["draftkit_contract"]
    if contract.get("draft_vocab"):
        notes.append(f"draft vocabulary {contract['draft_vocab']}: vLLM's llama_eagle.py has no d2t, so the "
                     "export (and our loop, which runs the export) drafts over the full vocabulary")
    return out, contract, notes


CUDA_SERVES = "a CUDA build of vLLM serves other head sizes"


def cpu_serving_refusal(target, export: Path) -> str | None:
    """Why vLLM's CPU build cannot serve this vLLM export on this target, or None (it can, or a CUDA
    device is visible). One rule, vllm_data.cpu_refusal (the attention head sizes vLLM's CPU backend
    runs), judged on the target's config (vLLM serves the target) and on the drafter's: the export's
    config.json, which vLLM builds the drafter's attention from (Medusa's heads have none)."""
    from types import SimpleNamespace

    from draftkit.engines.vllm_data import cpu_refusal

    cfg = json.loads((Path(export) / "config.json").read_text())
    family = (cfg.get("draftkit_contract") or {}).get("family", "draft")
    target_why = cpu_refusal(getattr(target, "config", None))
    head_why = cpu_refusal(SimpleNamespace(**cfg)) if cfg.get("num_attention_heads") else None
    if target_why and head_why == target_why:
        return (f"vLLM's CPU build cannot serve the target {target.name} nor the {family} head (its attention takes "
                f"the target's sizes): {target_why}")
    parts = ([f"the target {target.name}: {target_why}"] if target_why else []) + (
        [f"the {family} head (its vLLM export's config.json): {head_why}"] if head_why else [])
    return f"vLLM's CPU build cannot serve {'; nor '.join(parts)}" if parts else None


def verifier_dir(contract: dict, model_dir: str | None = None) -> str:
    """The target directory vLLM loads: model_dir, else the verifier the export's contract names."""
    model_dir = model_dir or (contract.get("verifier") or {}).get("name_or_path")
    if not model_dir or not Path(model_dir).is_dir():
        raise ValueError(f"the export names no local verifier directory ({model_dir!r}); pass model_dir")
    return model_dir


def served_head(export: Path, target, work: Path):
    """The head vLLM serves, as a draftkit head: the export imported back (bit-identical, test_export.py)."""
    from draftkit.export import import_head
    from draftkit.heads import load_head

    native = import_head(export, "vllm", work / "served-native", target=target, overwrite=True)
    return load_head(native, target).to(dtype=target.dtype).eval()


def run_name(t: float, b: int) -> str:
    return f"T={t:g} B={b}"


def _runs(s: EngineEvalSettings, stop_ids: list[int]) -> list[EngineRun]:
    return [EngineRun(run_name(t, b), Sampling(temperature=t, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                               max_tokens=s.max_new_tokens, ignore_eos=s.ignore_eos,
                                               stop_token_ids=[] if s.ignore_eos else stop_ids), b)
            for t in s.temperatures for b in s.batch_sizes]


def run_loop(target, head, prompts: list[list[int]], s: EngineEvalSettings, k: int, stop_ids: list[int]) -> dict:
    """Our chain under the engine rule, batch by batch, per (temperature, batch size): outputs, SpecStats."""
    from draftkit.inference.sampling import SamplingParams

    dec = loop_decoder(target, head, k, [] if s.ignore_eos else list(stop_ids))
    out = {}
    for t, B in ((t, b) for t in s.temperatures for b in (s.loop_batch_sizes or s.batch_sizes)):
        params = SamplingParams(temperature=t, top_k=s.top_k, top_p=s.top_p)
        outputs, total = [], None
        for i in range(0, len(prompts), B):
            chunk = prompts[i:i + B]
            o, st = dec.generate(chunk, s.max_new_tokens, params, seeds=[s.seed + i + j for j in range(len(chunk))])
            outputs += o
            total = st if total is None else total.__iadd__(st)
        out[run_name(t, B)] = {"outputs": outputs, "stats": total, "engine_rule": dec.engine_rule or t == 0}
    return out


def engine_eval(target, head_dir: str | Path, prompts: list[list[int]], s: EngineEvalSettings,
                plain: dict[str, list[list[int]]] | None = None) -> dict:
    """Serve plain / ngram / the head in vLLM and compare with our loop (see the module doc).

    plain: vLLM plain's outputs per run name ("T=0 B=4") from an earlier engine_eval on the same
    prompts and settings (plain_outputs), for a run that does not serve "plain" itself, so that its
    T = 0 check "vLLM with the head = vLLM plain" still runs (benchmarks/engine_vllm.py: several heads,
    plain served once). A run that serves plain checks against its own."""
    from draftkit.export.vllm import window_note
    from draftkit.inference.decoder import stop_token_ids

    work = Path(s.work_dir or tempfile.mkdtemp(prefix="draftkit-engine-eval-"))
    export, contract, notes = prepare_export(Path(head_dir), target, work)
    window = window_note(target, contract["family"], max(map(len, prompts), default=0) + s.max_new_tokens)
    if window:  # the export logged the note; the report's copy adds whether this run crosses the window
        notes.append(window)
    refusal = cpu_serving_refusal(target, export)  # the benchmarks' path too, before vLLM starts
    if refusal:
        raise ValueError(f"vLLM: {refusal}; {CUDA_SERVES}")
    family = contract["family"]
    k = contract["head"].get("num_heads", s.k) if family == "medusa" else s.k
    model_dir = verifier_dir(contract, s.model_dir)
    stop_ids = stop_token_ids(target)
    runs = _runs(s, stop_ids)
    engine = {}
    for method in s.methods:
        python = s.python
        if method == "suffix":
            try:
                python = find_suffix_python(s.python)
            except EngineUnavailable as e:
                notes.append(f"vLLM suffix not served: {e}")
                continue
        spec = speculative_config(family if method == "head" else method, k, export, ngram=s.ngram)
        inspect_it = s.inspect_drafter and method == "head"
        req = EngineRequest(model_dir, prompts, runs, spec, dtype=s.dtype, seed=s.seed, inspect_drafter=inspect_it,
                            drafter_files=[str(f) for f in sorted(export.glob("*.safetensors"))] if inspect_it else [],
                            cpu_sampler_fix=s.cpu_sampler_fix and any(t > 0 for t in s.temperatures))
        log.info("vLLM: serving %s", spec or "plain")
        engine[method] = serve(req, python=python, timeout=s.timeout_s)
    report = {"family": family, "k": k, "export": str(export), "model_dir": model_dir, "notes": notes,
              "settings": asdict(s), "vllm_version": next(iter(engine.values()))["vllm_version"] if engine else None,
              "engine": {}, "loop": {}, "comparison": {}, "failures": []}
    report["cpu_sampler_fix"] = {m: res.get("cpu_sampler_fix", "off") for m, res in engine.items() if m != "plain"}
    report["notes"] += sampler_notes(report["cpu_sampler_fix"], s)
    for m, res in engine.items():
        report["engine"][m] = {r["name"]: _engine_run(r, k if m != "plain" else 0) for r in res["runs"]}
        report["engine"][m]["load_seconds"] = res["load_seconds"]
        if res.get("drafter"):
            report["drafter"] = res["drafter"]
    report["engine_plain_source"] = ("this run" if "plain" in engine else "an earlier run (plain=)" if plain
                                     else None)
    if s.loop and "head" in s.methods:
        _compare_loop(report, served_head(export, target, work), target, prompts, s, k, stop_ids, engine,
                      plain=plain)
    report["ok"] = not report["failures"]
    return report


CPU_SAMPLER_DEFECT = ("vLLM CPU 0.32.0's rejection sampler divides the target's logits by uninitialised memory at "
                      "T > 0, not by the temperature (vllm/utils/cpu_triton_utils.py:390-404: expand's float output "
                      "is never written; rejection_sampler.py:550-558), so as shipped it accepts close to nothing "
                      "and its recovered tokens do not follow the target (benchmarks/vllm_t1_trace.py)")


def sampler_notes(fix: dict, s: EngineEvalSettings) -> list[str]:
    """What the T > 0 engine figures are: vLLM's rule (the defect corrected) or vLLM CPU as shipped."""
    if not any(t > 0 for t in s.temperatures) or not fix:
        return []
    if any(v == "applied" for v in fix.values()):
        return [CPU_SAMPLER_DEFECT + "; served with draftkit's correction (engines/vllm_worker.py: "
                "fix_cpu_rejection_sampler), so the T > 0 figures are vLLM's rule, as its GPU kernel applies it"]
    if all(v == "off" for v in fix.values()):
        return ["T > 0 served by vLLM CPU as shipped (cpu_sampler_fix off): " + CPU_SAMPLER_DEFECT]
    return []


def _engine_run(r: dict, k: int) -> dict:
    f = engine_figures(r["counters"], k) if k else {}
    return {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"], "new_tokens": r["new_tokens"],
            "counters": r["counters"], **f, "outputs": r["outputs"]}


def plain_outputs(report: dict) -> dict[str, list[list[int]]]:
    """{run name: vLLM plain's outputs} of an engine_eval report that served plain ({} if none, or
    once the outputs were taken out); what engine_eval's `plain` takes for the next head."""
    return {n: r["outputs"] for n, r in report.get("engine", {}).get("plain", {}).items()
            if isinstance(r, dict) and "outputs" in r}


def greedy_outputs_check(dtype: str, prompts, engine_head, engine_plain, loop, scorer=None) -> dict:
    """The T = 0 output checks of one run, the one place they are made: vLLM with the head against
    vLLM plain (engine_plain None: no plain to compare with, reported as None) and our loop against
    vLLM with the head. fp32: any difference from plain is a failure; 16-bit: every first difference
    scored by the teacher-forced criterion (classify_divergences with scorer(), a TeacherForced,
    called only then). {"outputs": ..., "near_ties": ... (16-bit), "failures": [...]}"""
    c = {"outputs": {"engine_head_equals_engine_plain": None if engine_plain is None else engine_head == engine_plain,
                     "loop_equals_engine_head": loop == engine_head,
                     "engine_head_vs_plain_first_differences": None if engine_plain is None
                     else first_differences(engine_head, engine_plain),
                     "loop_vs_engine_head_first_differences": first_differences(loop, engine_head)},
         "failures": []}
    if dtype == "float32":
        if engine_plain is not None and engine_head != engine_plain:
            c["failures"].append("T=0: vLLM with the head did not reproduce vLLM plain's greedy tokens")
    else:
        c["near_ties"] = classify_divergences(prompts, scorer(), engine_plain, engine_head, loop)
        c["failures"] += [f"T=0 ({dtype}): {f}" for f in c["near_ties"]["failures"]]
    return c


def _compare_loop(report, head, target, prompts, s, k, stop_ids, engine, plain=None) -> None:
    """Our loop under the engine rule beside vLLM with the head, per run; at T = 0 the output checks
    (greedy_outputs_check) against vLLM plain: this report's own, else plain ({run name: outputs})."""
    from functools import lru_cache

    from draftkit.inference.stats import TeacherForced

    loop = run_loop(target, head, prompts, s, k, stop_ids)
    plain = plain_outputs(report) or plain or {}
    scorer = lru_cache(maxsize=None)(lambda: TeacherForced(target))  # made once, on the first 16-bit check
    for name, res in loop.items():
        report["loop"][name] = {**loop_figures(res["stats"]), "tokens_per_s": res["stats"].tokens_per_s,
                                "engine_rule": res["engine_rule"], "outputs": res["outputs"]}
    for t, b in ((t, b) for t in s.temperatures for b in s.batch_sizes):
        name = run_name(t, b)
        loop_b = b if b in (s.loop_batch_sizes or s.batch_sizes) else min(s.loop_batch_sizes)
        res = loop[run_name(t, loop_b)]
        ours = report["loop"][run_name(t, loop_b)]
        eng = report["engine"]["head"][name]
        greedy = name.startswith("T=0 ")
        if not res["engine_rule"]:
            report["comparison"][name] = {"skipped": "this loop samples its drafts (no draft_sampling='greedy')"}
            continue
        c = compare(ours, eng, greedy_fp32=greedy and s.dtype == "float32")
        if greedy:
            g = greedy_outputs_check(s.dtype, prompts, eng["outputs"], plain.get(name), res["outputs"], scorer)
            c["failures"] += g.pop("failures")
            c.update(g)
        report["comparison"][name] = c
        report["failures"] += [f"{name}: {f}" for f in c["failures"]]


def classify_divergences(prompts, scorer, plain, engine_head, loop) -> dict:
    """16-bit T = 0: every first difference between vLLM with the head and vLLM plain, and between our
    loop and vLLM with the head, scored by the teacher-forced criterion (inference/stats.py:
    compare_greedy: on the shared prefix the target's float32 log-probabilities put both tokens within
    the 16-bit tie gap of the top). A (k+1)-token verify and a 1-token step, or vLLM's kernels and
    transformers', round differently in bf16, so near-ties swap and the continuations (and with them
    the acceptance counts) part; a difference outside the gap is a bug, named in "failures"."""
    from draftkit.inference.stats import compare_greedy

    out, failures = {}, []
    pairs = {"engine_head_vs_engine_plain": (engine_head, plain), "loop_vs_engine_head": (loop, engine_head)}
    for key, (a, b) in pairs.items():
        if b is None:
            continue
        r = compare_greedy(a, b, prompts, scorer)
        out[key] = {k: r[k] for k in ("mismatches", "near_ties", "max_gap", "tolerance", "divergences")}
        failures += [f"{key.replace('_', ' ')}: {f}" for f in r["failures"]]
    out["failures"] = failures
    return out


def first_differences(a: list[list[int]], b: list[list[int]]) -> dict[int, int]:
    """{prompt index: first output position where a and b differ} for the prompts whose outputs differ
    (a length difference counts at the shorter one's end): how many prompts, and how deep, a bf16 run's
    numerics moved; fp32 must give {}."""
    out = {}
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out[i] = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return out


def format_report(report: dict) -> str:
    """A table: per method and temperature vLLM's tokens/s, tau and alpha_i; then ours vs engine's."""
    lines = [f"vLLM {report['vllm_version']} serving {report['family']} (k={report['k']}) from {report['export']}"]
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append(f"{'method':<10} {'run':<8} {'tok/s':>8} {'tau':>6}  alpha per position")
    for m, runs in report["engine"].items():
        for name, r in runs.items():
            if not isinstance(r, dict) or "tokens_per_s" not in r:
                continue
            alpha = " ".join(f"{a:.3f}" if a is not None else "-" for a in r.get("alpha", []))
            tau = f"{r['tau']:.3f}" if r.get("tau") else "-"
            lines.append(f"{'vllm ' + m:<10} {name:<8} {r['tokens_per_s']:>8.1f} {tau:>6}  {alpha}")
    for name, r in report["loop"].items():
        alpha = " ".join(f"{a:.3f}" if a is not None else "-" for a in r["alpha"])
        lines.append(f"{'ours':<10} {name:<8} {r['tokens_per_s']:>8.1f} {r['tau']:>6.3f}  {alpha}  (engine rule)")
    for name, c in report["comparison"].items():
        if "skipped" in c:
            lines.append(f"{name}: comparison skipped: {c['skipped']}")
            continue
        for row in c["positions"]:
            d = f"{row['diff']:+.4f}" if row["diff"] is not None else "-"
            tol = f"{row['tolerance']:.4f}" if row["tolerance"] is not None else "-"
            lines.append(f"{name} alpha_{row['position']}: ours {row['ours']}, engine {row['engine']}, diff {d}, "
                         f"tolerance {tol}: {'ok' if row['ok'] else 'OUTSIDE'}")
        t = c["tau"]
        lines.append(f"{name} tau: ours {t['ours']:.4f}, engine {t['engine']:.4f}, tolerance {t['tolerance']:.4f}: "
                     f"{'ok' if t['ok'] else 'OUTSIDE'}")
    for name, c in report["comparison"].items():
        diffs = c.get("outputs", {})
        for key, label in (("engine_head_vs_plain_first_differences", "vLLM head vs vLLM plain"),
                           ("loop_vs_engine_head_first_differences", "our loop vs vLLM head")):
            if diffs.get(key):
                first = sorted(diffs[key].values())
                lines.append(f"{name} outputs, {label}: {len(first)} prompts differ, "
                             f"first at token {first[0]}, median {first[len(first) // 2]}")
    for name, c in report["comparison"].items():
        for key, r in (c.get("near_ties") or {}).items():
            if key != "failures" and r["mismatches"]:
                gap = "-" if r["max_gap"] is None else f"{r['max_gap']:.3f}"
                lines.append(f"{name} {key.replace('_', ' ')}: {r['mismatches']} first differences, {r['near_ties']} "
                             f"near-ties (both tokens within {r['tolerance']:g} nats of the float32 top; largest "
                             f"gap {gap})")
    lines.append("OK: the engine's acceptance agrees with draftkit's loop" if report["ok"]
                 else "FAIL: " + "; ".join(report["failures"]))
    return "\n".join(lines)


# ---- `draftkit eval --engine vllm` ------------------------------------------------------------------

def add_arguments(p) -> None:
    """The flags `draftkit eval` adds for the engine (the rest are eval's own)."""
    p.add_argument("--engine", default="draftkit", choices=["draftkit", "vllm"],
                   help="vllm: serve the head (a native head, exported here, or a vLLM export) in vLLM and report "
                        "vLLM's own tau / acceptance per position / tokens/s beside vLLM plain, vLLM's ngram and "
                        "draftkit's loop under vLLM's rule (a chain of --k, greedy drafts); exit 1 when ours and "
                        "the engine's differ beyond the tolerance. Without --k, --draft auto takes the chain a "
                        "previous run measured in vLLM (--draft-from, the head's engine_draft, --out/engine_draft.json) "
                        "or measures it now: vLLM plain and chains of each --engine-k on --calibration-prompts "
                        "prompts (engines/vllm_auto.py); --save-draft also writes it into the head")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="the Python with vLLM (default: $DRAFTKIT_VLLM_PYTHON, this one, or "
                        "$DRAFTKIT_CACHE/vllm-venv from scripts/setup_vllm.sh)")
    p.add_argument("--no-suffix", action="store_true",
                   help="--engine vllm: leave out vLLM's suffix method (served beside ngram where the arctic-inference "
                        "package imports: scripts/setup_vllm_suffix.sh; otherwise the report notes why not)")
    p.add_argument("--engine-k", type=int, nargs="+", default=list(DEFAULT_KS), metavar="K",
                   help="--engine vllm --draft auto|calibrate: the chain lengths (num_speculative_tokens) measured "
                        "in vLLM (Medusa: only its number of heads)")


def engine_draft_choice(args, head_dir: Path, out: Path, target) -> tuple[int | None, str, dict | None]:
    """(k, where it came from, the saved engine_draft) for --engine vllm; k None = measure now.
    --k wins; --draft chain without --k is a chain of 3; auto reuses a saved choice (vllm_auto.py)."""
    from draftkit.engines.vllm_auto import saved_choice

    tree_flags = [f for f in ("tree_topk", "tree_depth", "tree_budget", "lookup_len", "head_off_at")
                  if getattr(args, f, None) is not None]
    if args.draft in ("tree", "hybrid", "lookup") or tree_flags:
        raise ValueError(f"--engine vllm serves chains (num_speculative_tokens), not {args.draft if not tree_flags else tree_flags}: "
                         "pass --k K, or --draft auto to measure k in vLLM")
    if args.k is not None:
        return args.k, "flags", None
    if args.draft == "chain":
        return 3, "defaults (--draft chain without --k: 3)", None
    if args.draft == "calibrate":
        return None, "measured now", None
    saved, source = saved_choice(args.draft_from, head_dir, out, target)
    if saved is None:
        return None, "measured now", None
    v = saved["vllm"]
    return v["num_speculative_tokens"] or v["best"]["k"], source, saved


def measure_engine_draft(args, target, export: Path, contract: dict, prompts, out: Path, python: str) -> dict:
    """--draft auto/calibrate: the sweep on calibration prompts (calibrate.py's spread and token cap),
    written to --out/engine_draft.json."""
    from draftkit.engines.vllm_auto import (ENGINE_CALIBRATION_PROMPTS, ENGINE_DRAFT_FILE, SweepSettings, choice_file,
                                            engine_auto, format_sweep)
    from draftkit.inference.calibrate import MAX_CALIBRATION_TOKENS, calibration_prompts
    from draftkit.inference.decoder import stop_token_ids
    from draftkit.inference.evaluate import _prepare
    from draftkit.inference.report import atomic_write

    items, _ = _prepare(target, prompts, max(args.engine_k) + 1, args.max_new_tokens)
    n = ENGINE_CALIBRATION_PROMPTS if args.calibration_prompts is None else args.calibration_prompts
    calib = calibration_prompts(items, n)
    if not calib:
        raise ValueError("engine draft auto: no prompt fits the context")
    s = SweepSettings(ks=tuple(args.engine_k), temperatures=tuple(args.temperature), batch_size=args.batch_size,
                      max_new_tokens=min(MAX_CALIBRATION_TOKENS, args.max_new_tokens), top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, dtype=str(target.dtype).replace("torch.", ""), python=python)
    head = served_head(export, target, out)
    choice = engine_auto(target, export, contract, verifier_dir(contract), calib, s, stop_token_ids(target), head=head,
                         loop_budget_s=args.calibration_budget)
    engine_draft = {k: v for k, v in choice.items() if k != "sweep"}
    print(format_sweep(engine_draft), file=sys.stderr, flush=True)
    atomic_write(out / ENGINE_DRAFT_FILE, json.dumps(choice_file(engine_draft, _head_dir(args.head), target),
                                                    indent=2, default=str))
    return engine_draft


def run_cli(args) -> int:
    """`draftkit eval --engine vllm`: same prompts, --limit and sampling flags as eval."""
    from draftkit.engines.vllm import EngineError, EngineUnavailable, find_python
    from draftkit.engines.vllm_auto import set_config_key, with_sglang
    from draftkit.export import ExportError
    from draftkit.heads.base import HeadError
    from draftkit.inference.drafters import DraftSettings
    from draftkit.inference.evaluate import encode, read_prompt_file, synthesize_prompts
    from draftkit.inference.report import atomic_write
    from draftkit.target import TargetError, load_target

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    try:
        if not args.head:
            raise ValueError("--engine vllm serves a head: pass --head DIR (a native head or a vLLM export)")
        python = find_python(args.vllm_python)
        target = load_target(args.target, dtype=args.dtype)
        head_dir = _head_dir(args.head)
        k, source, engine_draft = engine_draft_choice(args, head_dir, out, target)
        out.mkdir(parents=True, exist_ok=True)
        export, contract, notes = prepare_export(head_dir, target, out)  # --out/vllm-export (or the export itself)
        refusal = cpu_serving_refusal(target, export)  # before any prompt is synthesized or served
        if refusal:
            raise ValueError(f"--engine vllm: {refusal}; {CUDA_SERVES}; --engine draftkit measures the head in "
                             "draftkit's own loop")
        prompts = [p for f in args.prompts or [] for p in read_prompt_file(f)]
        if not args.prompts:
            prompts = synthesize_prompts(target, args.num_synthesized, args.seed, progress=True)
        prompts = prompts[: args.limit]
        ids = [i for i in (encode(target.tokenizer, p) for p in prompts) if i]
        if k is None:
            engine_draft = measure_engine_draft(args, target, export, contract, prompts, out, python)
            source = f"measured now in vLLM (written to {out / 'engine_draft.json'})"
            v = engine_draft["vllm"]
            k = v["num_speculative_tokens"] or v["best"]["k"]
        engine_draft, draft_sources = with_sglang(engine_draft, source, head_dir)  # a reuse keeps SGLang's
        if engine_draft and export.resolve() != head_dir.resolve():  # the export eval made carries the choice
            set_config_key(export, engine_draft)
        if args.save_draft:
            if not engine_draft:
                raise ValueError("--save-draft with --engine vllm saves the chain measured in vLLM: use --draft "
                                 "auto or calibrate without --k")
            print(f"wrote the engine draft to {set_config_key(head_dir, engine_draft)} ({'engine_draft'})",
                  file=sys.stderr)
        _say_choice(engine_draft, k, source)
        if "sglang" in draft_sources and draft_sources["sglang"] != source:
            print(f"engine draft: SGLang's record from {draft_sources['sglang']}", file=sys.stderr)
        methods = tuple(m for m, off in (("plain", args.no_baseline), ("ngram", args.no_ngram),
                                         ("suffix", args.no_ngram or getattr(args, "no_suffix", False)), ("head", False)) if not off)
        s = EngineEvalSettings(k=k, temperatures=tuple(args.temperature), max_new_tokens=args.max_new_tokens,
                               batch_sizes=(args.batch_size,), top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                               dtype=str(target.dtype).replace("torch.", ""),  # --dtype auto resolved by the target
                               methods=methods, ngram=(1, args.ngram_n or DraftSettings.lookup_ngram), python=python,
                               work_dir=str(out))
        report = engine_eval(target, export, ids, s)
    except (EngineUnavailable, EngineError, ExportError, HeadError, TargetError, ValueError) as e:
        print(f"draftkit eval: error: {e}", file=sys.stderr)
        return 2
    report.update(notes=notes + report["notes"], draft_source=source, engine_draft=engine_draft,
                  engine_draft_source=draft_sources)
    atomic_write(out / "engine_vllm.json", json.dumps(report, indent=2, default=str))
    print(format_report(report))
    print(f"wrote {out / 'engine_vllm.json'}")
    return 0 if report["ok"] else 1


def _say_choice(engine_draft: dict | None, k: int, source: str) -> None:
    v = (engine_draft or {}).get("vllm")
    if v and v["choice"] == "plain":
        print(f"engine draft: vLLM should serve plain decoding (from {source}); the head is evaluated as its best "
              f"measured chain, k={k}", file=sys.stderr)
    else:
        print(f"engine draft: chain k={k} (from {source})", file=sys.stderr)


def _head_dir(path: str) -> Path:
    d = Path(path)
    return d / "head" if (d / "head" / "config.json").is_file() and not (d / "config.json").is_file() else d
