"""The flags a head should be served with, per engine, and where each shape was measured.

A contract (export/contract.py) may carry two choices that must not be confused:
  draft          the shape draftkit's OWN loop ran fastest on the machine that measured it
                 (`draftkit eval --draft auto`; chain, tree, hybrid with a lookup branch, lookup, plain);
  engine_draft   per engine, the shape that engine should serve:
                   vllm    measured IN vLLM (`draftkit eval --engine vllm --draft auto`, engines/vllm_auto.py):
                           tokens/s of chains k = 1..6 beside vLLM plain, in one run;
                   sglang  an SGLang-valid tree measured in draftkit's loop with SGLang's rule (SGLang has
                           no CPU path here, so never engine-measured).
`serving_lines` prints both engines' flags from engine_draft when present, else from the loop's
choice, saying which it is; a loop shape an engine cannot serve (a lookup branch, a tree for vLLM's
chains) is said so, never translated into a different shape silently.

SGLang's rule (python/sglang/srt/server_args.py, _handle_eagle_family; speculative/eagle_utils.py,
organize_draft_results; eagle_worker.py): an EAGLE-2 tree of --speculative-num-steps levels, each
expanding the --speculative-eagle-topk best frontier nodes into topk children by cumulative draft
score, of which the --speculative-num-draft-tokens - 1 best candidates are verified (so at most
topk + (steps - 1) * topk^2 of them); with topk 1 SGLang sets num_draft_tokens = steps + 1 (a chain).
Drafts are the draft's top-k (never sampled) and verification accepts a child with the target's
probability (tree_speculative_sampling_target_only, thresholds 1): in distribution the walk of
draftkit's tree mode (inference/tree.py), whose growth is the same EAGLE-2 rule.
"""
from __future__ import annotations

import json
import re

from draftkit.engines.vllm import FAMILY_METHOD as VLLM_METHOD  # draftkit family -> vLLM method

ENGINE_DRAFT_KEY = "engine_draft"
SGLANG_ALGORITHM = {"eagle": "EAGLE", "eagle3": "EAGLE3"}  # SGLang has no Medusa / llama-layer MTP drafter
SGLANG_NOT_MEASURED = "not engine-measured (SGLang has no CPU path here)"
MEASURE_VLLM = "draftkit eval --engine vllm --head DIR --draft auto"


def sglang_invalid(topk: int, depth: int, budget: int) -> str | None:
    """Why (topk, depth, budget nodes) is not a tree SGLang serves as drafted, or None when it is."""
    if topk == 1 and budget != depth:
        return f"topk 1 is a chain: SGLang sets num_draft_tokens = num_steps + 1 = {depth + 1}, not {budget + 1}"
    if budget > topk + (depth - 1) * topk * topk:
        return (f"{budget} draft tokens exceed the {topk + (depth - 1) * topk * topk} candidates an EAGLE tree of "
                f"topk {topk}, {depth} steps has (organize_draft_results)")
    return None


def sglang_flags(family: str, topk: int, depth: int, budget: int) -> str:
    return (f"--speculative-algorithm {SGLANG_ALGORITHM[family]} --speculative-num-steps {depth} "
            f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {budget + 1}")


def sglang_record(rows: list[dict], family: str, pays: float, about: dict) -> dict | None:
    """engine_draft.sglang from a loop calibration's ranked rows (inference/cost.py choose(): each
    {candidate, label, speedup, by_temperature}): the best lookup-free tree SGLang can serve, or
    plain when none is predicted faster than `pays` x plain. None for a family SGLang does not serve."""
    if family not in SGLANG_ALGORITHM:
        return None
    trees = [r for r in rows if r["candidate"].topk and not r["candidate"].lookup_len
             and sglang_invalid(r["candidate"].topk, r["candidate"].depth, r["candidate"].budget) is None]
    rec = {"engine": "sglang", "engine_measured": False, "measured_in": "draftkit's loop (inference/cost.py: "
           "traced calibration prompts, costs timed here), SGLang's rule (EAGLE-2 tree, top-k drafts, "
           "target-only verification)", "margin": pays, **about}
    if not trees or trees[0]["speedup"] <= pays:
        best = trees[0] if trees else None
        return {**rec, "choice": "plain", "best_tree": best and best["label"],
                "predicted_speedup": best and round(best["speedup"], 4)}
    best, c = trees[0], trees[0]["candidate"]
    return {**rec, "choice": "tree", "algorithm": SGLANG_ALGORITHM[family], "speculative_num_steps": c.depth,
            "speculative_eagle_topk": c.topk, "speculative_num_draft_tokens": c.budget + 1,
            "predicted_speedup": round(best["speedup"], 4), "by_temperature": best["by_temperature"]}


def sglang_from_calibration(cal, family: str, target, margin: float, max_new_tokens: int) -> dict | None:
    """engine_draft.sglang from a loop calibration (inference/cost.py auto_draft's Calibration: its
    ranked rows, temperatures, traces, warnings), with what it was measured on: `draftkit eval
    --draft auto` (cli_eval.py) and `--engine vllm --draft auto` (engines/vllm_auto.py) both record
    it so. None for a family SGLang does not serve."""
    about = {**measured_on([float(t) for t in cal.costs], str(target.dtype).replace("torch.", ""), 1,
                           len(next(iter(cal.traces.values()))), max_new_tokens), "warnings": list(cal.warnings)}
    return sglang_record(cal.rows, family, margin, about)


def measured_on(temperatures: list, dtype: str, batch_size: int, prompts: int, max_new_tokens: int) -> dict:
    """What an engine_draft choice was measured on (settings, CPU flags, machine, UTC time), recorded beside it."""
    import platform
    import time

    from draftkit.target import cpu_flags

    return {"temperatures": temperatures, "dtype": dtype, "batch_size": batch_size, "prompts": prompts,
            "max_new_tokens": max_new_tokens, "cpu_flags": cpu_flags(),
            "machine": platform.processor() or platform.machine(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def sglang_summary(rec: dict) -> str:
    """engine_draft.sglang in one terminal line (eval prints it when it records one)."""
    what = ("plain: no SGLang-valid tree predicted to pay" if rec["choice"] == "plain" else
            f"tree topk {rec['speculative_eagle_topk']} steps {rec['speculative_num_steps']} draft tokens "
            f"{rec['speculative_num_draft_tokens']}, predicted {rec['predicted_speedup']}x")
    return f"engine draft auto: SGLang ({what}) measured in draftkit's loop, not engine-measured"


# ---- inspect -----------------------------------------------------------------------------------------

def serving_lines(contract: dict, directory: str | None = None) -> list[str]:
    """`draftkit inspect`'s lines: the loop's shape, then vLLM's and SGLang's flags (module doc)."""
    family, draft = contract.get("family"), contract.get("draft")
    engines = contract.get(ENGINE_DRAFT_KEY) or {}
    model = directory if contract.get("format") == "vllm" and directory else "<its vLLM export>"
    return [*loop_lines(draft), *vllm_lines(family, engines.get("vllm"), draft, model, contract.get("head") or {}),
            *sglang_lines(family, engines.get("sglang"), draft)]


def loop_lines(draft: dict | None) -> list[str]:
    if not draft:
        return ["draftkit loop's draft shape: not measured (draftkit eval --head DIR chooses it)"]
    return [f"draftkit loop's draft shape: {_describe(draft)} ({draft.get('chosen_by')}); the shape draftkit's own "
            "loop runs fastest, not an engine's"]


def _describe(d: dict) -> str:
    mode = d.get("mode")
    if mode == "chain":
        return f"chain k={d.get('k')}"
    if mode in ("tree", "hybrid"):
        s = f"tree topk={d.get('topk')} depth={d.get('depth')} budget={d.get('budget')}"
        return s + (f" + lookup branch {d.get('lookup_len')}" if mode == "hybrid" else "")
    return "prompt lookup alone" if mode == "lookup" else str(mode)


def vllm_lines(family: str, rec: dict | None, draft: dict | None, model: str, head: dict) -> list[str]:
    if family not in VLLM_METHOD:
        return [f"vLLM: no drafter for family {family} here"]
    if rec:
        return _vllm_measured(family, rec, model)
    if not draft or draft.get("mode") == "plain":
        said = "plain decoding, in draftkit's loop" if draft else "nothing"
        return [f"vLLM: measured {said}; NOT engine-measured: {MEASURE_VLLM} measures chains in vLLM"]
    if family == "medusa" or draft.get("mode") == "chain":
        k = head.get("num_heads") if family == "medusa" else draft.get("k")
        cfg = {"method": VLLM_METHOD[family], "model": model, "num_speculative_tokens": k}
        return [f"vLLM: speculative_config {json.dumps(cfg)}", f"  NOT engine-measured: the chain draftkit's loop "
                f"measured ({_describe(draft)}); vLLM's own speed differs ({MEASURE_VLLM})"]
    return [f"vLLM: no measured shape: draftkit's loop chose {_describe(draft)}, and vLLM serves chains "
            "(num_speculative_tokens) without a lookup branch, so no flags reproduce it (a chain of its depth would "
            f"be another, unmeasured shape); {MEASURE_VLLM} measures chains k = 1..6 in vLLM"]


def _vllm_measured(family: str, rec: dict, model: str) -> list[str]:
    where = (f"measured in vLLM {rec.get('vllm_version')}: {{}} vs plain {rec.get('plain_tok_s', 0):.1f} tok/s"
             f" ({', '.join(f'{k} {v}' for k, v in _setup(rec).items())})")
    if rec.get("choice") == "plain":
        best = rec.get("best") or {}
        return ["vLLM: serve plain decoding (no speculative_config): no chain beat plain by the margin "
                f"{rec.get('margin')}x", "  " + where.format(f"best chain k={best.get('k')}: "
                                                               f"{best.get('tok_s', 0):.1f} tok/s")]
    cfg = {"method": VLLM_METHOD[family], "model": model, "num_speculative_tokens": rec["num_speculative_tokens"]}
    return [f"vLLM: speculative_config {json.dumps(cfg)}",
            "  " + where.format(f"{rec.get('tok_s', 0):.1f} tok/s (tau {rec.get('tau', 0):.3f})")]


def _setup(rec: dict) -> dict:
    keys = ("temperatures", "dtype", "batch_size", "prompts", "max_new_tokens", "cpu_flags", "swept_k", "margin")
    return {k: rec[k] for k in keys if rec.get(k) is not None}


def sglang_lines(family: str, rec: dict | None, draft: dict | None) -> list[str]:
    if family not in SGLANG_ALGORITHM:
        return [f"SGLang: no drafter for family {family} (SGLang serves EAGLE and EAGLE-3 heads)"]
    if rec:
        if rec.get("choice") == "plain":
            return [f"SGLang: plain decoding predicted fastest: no SGLang-valid tree beat plain by {rec.get('margin')}x "
                    f"in draftkit's loop (best {rec.get('best_tree')}: {rec.get('predicted_speedup')}x); "
                    f"{SGLANG_NOT_MEASURED}"]
        flags = sglang_flags(family, rec["speculative_eagle_topk"], rec["speculative_num_steps"],
                             rec["speculative_num_draft_tokens"] - 1)
        return [f"SGLang: {flags}", f"  {SGLANG_NOT_MEASURED}: the best SGLang-valid tree in draftkit's loop with "
                f"SGLang's rule, predicted {rec.get('predicted_speedup')}x over plain ({rec.get('dtype')}, "
                f"{rec.get('cpu_flags')})"]
    return _sglang_from_loop(family, draft)


def _sglang_from_loop(family: str, draft: dict | None) -> list[str]:
    if not draft or draft.get("mode") in ("plain", "lookup"):
        said = {None: "no draft shape measured", "plain": "the loop measured plain decoding fastest",
                "lookup": "the loop chose prompt lookup alone, not an EAGLE tree"}[draft and draft.get("mode")]
        return [f"SGLang: no EAGLE flags: {said}; {SGLANG_NOT_MEASURED}"]
    if draft["mode"] == "chain":
        k = draft["k"]
        rule = ("" if draft.get("draft_sampling") == "greedy" else "; at T > 0 our loop sampled the chain's drafts, "
                "SGLang drafts the top-1")
        return [f"SGLang: {sglang_flags(family, 1, k, k)}", f"  {SGLANG_NOT_MEASURED}: the chain draftkit's loop "
                f"chose{rule}"]
    topk, depth, budget = draft["topk"], draft["depth"], draft["budget"]
    if draft["mode"] == "tree" and sglang_invalid(topk, depth, budget) is None:
        return [f"SGLang: {sglang_flags(family, topk, depth, budget)}",
                f"  {SGLANG_NOT_MEASURED}: the tree draftkit's loop chose (EAGLE-2 growth, SGLang's rule)"]
    alt = _best_pure_tree((draft.get("measured") or {}).get("top_candidates") or [])
    if alt:
        (k, d, b), speedup = alt
        return [f"SGLang: {sglang_flags(family, k, d, b)}", f"  {SGLANG_NOT_MEASURED}: the best lookup-free "
                f"tree among the loop calibration's top shapes (predicted {speedup}x); the loop's own choice "
                f"({_describe(draft)}) has a lookup branch SGLang cannot serve"]
    why = sglang_invalid(topk, depth, budget) or "its lookup branch is not served by SGLang"
    return [f"SGLang: no measured flags: draftkit's loop chose {_describe(draft)}: {why}; the tree alone was not "
            f"measured (draftkit eval --engine vllm --head DIR --draft auto also ranks SGLang-valid trees); "
            f"{SGLANG_NOT_MEASURED}"]


def _best_pure_tree(top: list[dict]) -> tuple[tuple[int, int, int], float] | None:
    """The first lookup-free, SGLang-valid tree in a calibration's top candidates ("tree 8x1 b8")."""
    for row in top:
        m = re.fullmatch(r"tree (\d+)x(\d+) b(\d+)", str(row.get("shape", "")))
        if m and sglang_invalid(*map(int, m.groups())) is None:
            return tuple(map(int, m.groups())), row.get("speedup")
    return None
