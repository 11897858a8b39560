"""`draftkit eval --engine vllm --draft auto`: the shape vLLM should serve, measured in vLLM.

    choice = engine_auto(target, export_dir, contract, calibration_ids, SweepSettings(ks=(1, 2, 3, 4, 5, 6)))
    choice["vllm"]     # measured in vLLM: {choice, num_speculative_tokens, tok_s, plain_tok_s, tau, ...}
    choice["sglang"]   # an SGLang-valid tree measured in draftkit's loop (not engine-measured)

vLLM: the engine-valid shapes are chains of k = num_speculative_tokens (EAGLE, EAGLE-3: SweepSettings.ks,
default 1..6; Medusa: only its number of heads, since vllm/v1/spec_decode/medusa.py proposes every head
at once and asserts num_speculative_tokens equals it). One vLLM worker process serves vLLM plain and
then each chain on the calibration prompts (vllm_worker.py `engines`; each engine ~20-30 s to build),
every engine first decoding a short warm-up run that is not timed. The choice maximises vLLM's
tokens/s over vLLM plain's from the same run (mean over the temperatures); where no chain beats
plain by `margin` (PAYS = 1.05, the margin draftkit's own cost model uses) the choice is plain.
One measurement per engine: on a shared machine a difference of a few percent is noise.

SGLang: draftkit's loop calibration (inference/cost.py auto_draft) on the same prompts; the best
lookup-free tree SGLang serves (export/serving.py: sglang_record, SGLang's rule) or plain.

Where the choice goes (eval never writes into a trained head unless asked, as for the loop's
draft.json): --out/engine_draft.json, and the contract of the export eval serves (--out/vllm-export);
--save-draft also sets `engine_draft` in the head's config.json (a native head: `draftkit export`
carries it into every export's contract) or in a vLLM export's contract. --draft auto reuses a saved
choice (--draft-from, the head's engine_draft, --out/engine_draft.json for the same head, target,
dtype and device) before measuring again; --draft calibrate always measures. A reused choice keeps its
SGLang record, or takes the head's (with_sglang); the report names where each came from
(engine_draft_source).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from draftkit.engines.vllm import EngineRequest, EngineRun, Sampling, engine_figures, serve, speculative_config
from draftkit.export.serving import ENGINE_DRAFT_KEY, measured_on, sglang_from_calibration, sglang_summary
from draftkit.inference.cost import PAYS

ENGINE_DRAFT_FILE = "engine_draft.json"
# The engine sweep's prompts when --calibration-prompts is not given. The sweep builds one vLLM engine per
# candidate (plain and a chain per --engine-k, ~20-30 s each to build) and has no time budget, and it only
# chooses a chain length of one head (lookup is not a candidate), so the loop's 16 would multiply its time
# for a choice that 4 prompts already make.
ENGINE_CALIBRATION_PROMPTS = 4
ENGINE_DRAFT_ABOUT = ("the shape each serving engine should serve this head with: `vllm` measured in vLLM (tokens/s "
                      "of chains beside vLLM plain, one run), `sglang` an SGLang-valid tree measured in draftkit's "
                      "loop (not engine-measured); not the shape draftkit's own loop runs fastest (draft.json)")
DEFAULT_KS = (1, 2, 3, 4, 5, 6)


@dataclass
class SweepSettings:
    ks: tuple[int, ...] = DEFAULT_KS  # chain lengths tried (num_speculative_tokens)
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 64  # per calibration prompt (calibrate.py's MAX_CALIBRATION_TOKENS)
    batch_size: int = 1
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    ignore_eos: bool = False
    margin: float = PAYS  # a chain is chosen only when this much faster than vLLM plain
    warmup_tokens: int = 8  # each engine's untimed warm-up run (every prompt, this many tokens)
    python: str | None = None
    timeout_s: float | None = None


def engine_ks(family: str, contract: dict, ks) -> list[int]:
    """The chain lengths vLLM can serve this head with (module doc)."""
    if family == "medusa":
        return [contract["head"]["num_heads"]]
    bad = [k for k in ks if not isinstance(k, int) or k < 1]
    if bad or not ks:
        raise ValueError(f"--engine-k: chain lengths must be integers >= 1, got {list(ks)}")
    return sorted(set(ks))


def sweep_request(model_dir: str, prompts: list[list[int]], export: Path, family: str, ks: list[int],
                  s: SweepSettings, stop_ids: list[int]) -> EngineRequest:
    """plain, then a chain of each k, one worker process; runs: the warm-up, then one per temperature."""
    def run(name, t, n):
        return EngineRun(name, Sampling(temperature=t, top_p=s.top_p, top_k=s.top_k, seed=s.seed, max_tokens=n,
                                        ignore_eos=s.ignore_eos, stop_token_ids=[] if s.ignore_eos else stop_ids),
                         s.batch_size)
    runs = [run("warmup", 0.0, s.warmup_tokens)] + [run(f"T={t:g}", t, s.max_new_tokens) for t in s.temperatures]
    engines = [{"name": "plain"}] + [{"name": f"k={k}", "speculative_config": speculative_config(family, k, export)}
                                     for k in ks]
    return EngineRequest(model_dir, prompts, runs, dtype=s.dtype, seed=s.seed, engines=engines,
                         cpu_sampler_fix=any(t > 0 for t in s.temperatures))  # vLLM CPU's T > 0 defect


def sweep(model_dir: str, prompts: list[list[int]], export: Path, family: str, ks: list[int], s: SweepSettings,
          stop_ids: list[int]) -> dict:
    """Serve the sweep; {vllm_version, plain: {T: tok/s}, rows: [{k, speedup, by_temperature: {T:
    {tok_s, speedup, tau, alpha, counters}}}], load_seconds, outputs: {engine: {T: outputs}}}."""
    res = serve(sweep_request(model_dir, prompts, export, family, ks, s, stop_ids), python=s.python,
                timeout=s.timeout_s)
    by_name = {e["name"]: {r["name"]: r for r in e["runs"] if r["name"] != "warmup"} for e in res["engines"]}
    temps = [f"T={t:g}" for t in s.temperatures]
    plain = {t: by_name["plain"][t]["tokens_per_s"] for t in temps}
    rows = []
    for k in ks:
        per_t = {}
        for t in temps:
            r = by_name[f"k={k}"][t]
            f = engine_figures(r["counters"], k)
            per_t[t] = {"tok_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / plain[t] if plain[t] else 0.0,
                        "tau": f["tau"], "alpha": f["alpha"], "counters": r["counters"]}
        rows.append({"k": k, "speedup": sum(p["speedup"] for p in per_t.values()) / len(per_t), "by_temperature": per_t})
    return {"vllm_version": res["vllm_version"], "plain": plain, "rows": rows,
            "load_seconds": {e["name"]: e["load_seconds"] for e in res["engines"]},
            "outputs": {n: {t: r["outputs"] for t, r in runs.items()} for n, runs in by_name.items()},
            "process_seconds": res.get("process_seconds")}


def choose_chain(rows: list[dict], margin: float) -> dict | None:
    """The row with the highest mean speedup over vLLM plain; None (plain) unless it exceeds margin."""
    best = max(rows, key=lambda r: r["speedup"], default=None)
    return best if best is not None and best["speedup"] > margin else None


def setup_about(s: SweepSettings, n_prompts: int) -> dict:
    """What a choice was measured on, recorded beside it (export/serving.py: measured_on)."""
    return measured_on(list(s.temperatures), s.dtype, s.batch_size, n_prompts, s.max_new_tokens)


def vllm_record(family: str, measured: dict, s: SweepSettings, n_prompts: int) -> dict:
    """engine_draft.vllm: the choice with its own and plain's tokens/s (means over the temperatures),
    tau and alpha at the first temperature (every temperature under by_temperature), and the sweep."""
    from draftkit.engines.vllm import FAMILY_METHOD

    rows, chosen = measured["rows"], choose_chain(measured["rows"], s.margin)
    best = max(rows, key=lambda r: r["speedup"])
    plain = sum(measured["plain"].values()) / len(measured["plain"])

    def summary(r):
        t0 = next(iter(r["by_temperature"].values()))
        return {"k": r["k"], "tok_s": sum(p["tok_s"] for p in r["by_temperature"].values()) / len(r["by_temperature"]),
                "speedup": r["speedup"], "tau": t0["tau"], "alpha": t0["alpha"],
                "by_temperature": {t: {x: p[x] for x in ("tok_s", "speedup", "tau", "alpha")}
                                   for t, p in r["by_temperature"].items()}}
    rec = {"engine": "vllm", "engine_measured": True, "vllm_version": measured["vllm_version"],
           "method": FAMILY_METHOD[family], "choice": "chain" if chosen else "plain",
           "num_speculative_tokens": chosen["k"] if chosen else None, "plain_tok_s": plain,
           "plain_by_temperature": measured["plain"], "margin": s.margin,
           "swept_k": [r["k"] for r in rows],
           "best": summary(best), "sweep": [summary(r) for r in rows], **setup_about(s, n_prompts)}
    if chosen:
        one = summary(chosen)
        rec.update(tok_s=one["tok_s"], speedup=one["speedup"], tau=one["tau"], alpha=one["alpha"],
                   by_temperature=one["by_temperature"])
    return rec


def loop_sglang(target, head, family: str, prompts: list[list[int]], s: SweepSettings,
                budget_s: float | None) -> dict | None:
    """engine_draft.sglang: draftkit's loop calibration (auto_draft) on the same prompts, the best
    SGLang-valid tree in its ranking (export/serving.py: sglang_from_calibration); None when SGLang has no
    drafter for the family."""
    from draftkit.export.serving import SGLANG_ALGORITHM
    from draftkit.inference.cost import auto_draft

    if family not in SGLANG_ALGORITHM:
        return None
    _, cal = auto_draft(target, head, prompts, temperatures=s.temperatures, top_k=s.top_k, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens, budget_s=budget_s, seed=s.seed, progress=True)
    return sglang_from_calibration(cal, family, target, s.margin, s.max_new_tokens)


def engine_auto(target, export: Path, contract: dict, model_dir: str, prompts: list[list[int]], s: SweepSettings,
                stop_ids: list[int], head=None, loop_budget_s: float | None = None) -> dict:
    """{"vllm": measured in vLLM, "sglang": from our loop (when `head`, the served head, is given
    and SGLang serves the family)}, plus "sweep": the raw vLLM measurements."""
    family = contract["family"]
    ks = engine_ks(family, contract, s.ks)
    measured = sweep(model_dir, prompts, export, family, ks, s, stop_ids)
    out = {"vllm": vllm_record(family, measured, s, len(prompts))}
    if head is not None:
        rec = loop_sglang(target, head, family, prompts, s, loop_budget_s)
        if rec is not None:
            out["sglang"] = rec
    return {**out, "sweep": measured}


def format_sweep(engine_draft: dict) -> str:
    """The sweep as a table and the choices, for the terminal."""
    v = engine_draft["vllm"]
    lines = [f"vLLM {v['vllm_version']} sweep ({v['prompts']} calibration prompts x {v['max_new_tokens']} tokens, "
             f"{v['dtype']}, batch {v['batch_size']}, T {v['temperatures']}, CPU {v['cpu_flags']}):",
             f"  plain     {v['plain_tok_s']:8.1f} tok/s"]
    for r in v["sweep"]:
        alpha = " ".join("-" if a is None else f"{a:.3f}" for a in r["alpha"])
        lines.append(f"  chain k={r['k']} {r['tok_s']:8.1f} tok/s  {r['speedup']:.2f}x  tau {r['tau'] or 0:.3f}  alpha {alpha}")
    lines.append(f"engine draft auto: vLLM should serve chain k={v['num_speculative_tokens']} ({v['speedup']:.2f}x vLLM "
                 f"plain, margin {v['margin']}x)" if v["choice"] == "chain" else
                 f"engine draft auto: vLLM should serve plain decoding: no chain beat vLLM plain by {v['margin']}x "
                 f"(best k={v['best']['k']}: {v['best']['speedup']:.2f}x)")
    if engine_draft.get("sglang"):
        lines.append(sglang_summary(engine_draft["sglang"]))
    return "\n".join(lines)


# ---- where the choice is kept ---------------------------------------------------------------------

def choice_file(engine_draft: dict, head_dir: Path, target) -> dict:
    """What --out/engine_draft.json holds: the choice and what it was measured for (the keys
    cli_eval.same_setup compares: head_dir, target fingerprint, dtype, device)."""
    return {"about": ENGINE_DRAFT_ABOUT, ENGINE_DRAFT_KEY: engine_draft, "head_dir": str(Path(head_dir).resolve()),
            "target": {"name": target.name, "fingerprint": target.fingerprint},
            "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device)}


def set_config_key(directory: Path, engine_draft: dict) -> Path:
    """engine_draft into a directory's config.json, atomically: a native head's top level, or a
    vLLM (or other) export's draftkit_contract."""
    from draftkit.export.files import CONTRACT_KEY
    from draftkit.inference.report import atomic_write

    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    (cfg[CONTRACT_KEY] if isinstance(cfg.get(CONTRACT_KEY), dict) else cfg)[ENGINE_DRAFT_KEY] = engine_draft
    try:
        return atomic_write(path, json.dumps(cfg, indent=2, default=str) + "\n")
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e} (a read-only directory? the choice is in "
                         f"--out/{ENGINE_DRAFT_FILE}; reuse it with --draft-from)") from e


def stored_choice(directory: Path) -> dict | None:
    """engine_draft kept in a directory: its engine_draft.json (an eval --out), else its config.json
    (a native head's top level, or an export's contract)."""
    from draftkit.export.files import CONTRACT_KEY

    directory = Path(directory)
    if (directory / ENGINE_DRAFT_FILE).is_file():
        return read_choice_file(directory / ENGINE_DRAFT_FILE)[ENGINE_DRAFT_KEY]
    if not (directory / "config.json").is_file():
        return None
    cfg = json.loads((directory / "config.json").read_text())
    return cfg.get(ENGINE_DRAFT_KEY) or (cfg.get(CONTRACT_KEY) or {}).get(ENGINE_DRAFT_KEY)


def read_choice_file(path: Path) -> dict:
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable engine_draft.json: {e}") from e
    if not isinstance(rec, dict) or not isinstance((rec.get(ENGINE_DRAFT_KEY) or {}).get("vllm"), dict):
        raise ValueError(f"{path}: no {ENGINE_DRAFT_KEY}.vllm object (expected draftkit eval --engine vllm's "
                         f"{ENGINE_DRAFT_FILE})")
    return rec


def saved_choice(draft_from: str | None, head_dir: Path, out: Path, target) -> tuple[dict | None, str]:
    """--draft auto's saved vLLM choice, in the module doc's order, and where it came from."""
    from draftkit.inference.cli_eval import same_setup

    if draft_from:
        got = stored_choice(Path(draft_from)) if Path(draft_from).is_dir() else \
            read_choice_file(Path(draft_from))[ENGINE_DRAFT_KEY]
        if not got or not got.get("vllm"):
            raise ValueError(f"--draft-from {draft_from}: no {ENGINE_DRAFT_KEY}.vllm there (an {ENGINE_DRAFT_FILE}, "
                             "its eval --out directory, or a head / export whose config.json carries one)")
        return got, str(draft_from)
    own = stored_choice(head_dir) if (Path(head_dir) / "config.json").is_file() else None
    if own and own.get("vllm"):
        return own, str(Path(head_dir) / "config.json")
    previous = out / ENGINE_DRAFT_FILE
    if previous.is_file():
        rec = read_choice_file(previous)
        if same_setup(rec, head_dir, target):
            return rec[ENGINE_DRAFT_KEY], str(previous)
        print(f"note: {previous} was measured for another head, target, dtype or device: measuring again",
              file=sys.stderr)
    return None, "none"


def with_sglang(engine_draft: dict | None, source: str, head_dir: Path) -> tuple[dict | None, dict]:
    """(engine_draft, where each engine's record came from) for a choice eval serves: a choice with
    its own SGLang record keeps it; a reused vLLM choice without one takes the head's (the loop's
    `draftkit eval --save-draft` keeps engine_draft.sglang in the head's config.json), so that writing
    the reused choice into the export or the head never drops it."""
    if not engine_draft:
        return engine_draft, {}
    sources = {"vllm": source}
    if engine_draft.get("sglang"):
        return engine_draft, {**sources, "sglang": source}
    own = stored_choice(head_dir) if (Path(head_dir) / "config.json").is_file() else None
    if own and own.get("sglang"):
        return {**engine_draft, "sglang": own["sglang"]}, {**sources, "sglang": str(Path(head_dir) / "config.json")}
    return engine_draft, sources
