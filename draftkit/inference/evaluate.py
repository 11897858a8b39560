"""`draftkit eval`'s library: the acceptance and speedup a serving engine would see, measured with the
real loop (the command line is draftkit/inference/cli_eval.py, calibration inference/calibrate.py).

For every temperature it decodes every prompt three ways, interleaved batch by batch so that load
on the machine hits all three alike: speculative decoding with the head, plain autoregressive
decoding of the same target (the baseline and, at T = 0, the reference the output must equal),
and prompt-lookup (n-gram) speculation (the baseline that needs no head). It writes report.json,
report.md and acceptance.png to --out and prints the table.

The trainer calls `evaluate(target, head, prompts, EvalSettings(draft=DraftSettings(mode="chain", k=k),
compare=()))` on a few held-aside prompts every N steps: the head's chain alone, no baseline, so it
returns tau and acceptance_per_position cheaply.

Prompt files are read here without `datasets` (eval must run on the core dependencies): JSON or
JSONL records in the shapes the training data loader reads (ShareGPT, OpenAI, MT-bench, `prompt`,
Alpaca; see draftkit/prompts.py, which both use), keeping `category` when present. Without prompt
files the target writes its own (Magpie, the trainer's draftkit/distill/synthesize.py).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from draftkit.inference.decoder import SpecDecoder, context_length, plain_generate, stop_token_ids
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.errors import SpecError
from draftkit.inference.stats import PlainStats, SpecStats, TeacherForced, compare_greedy
from draftkit.inference.typical import TYPICAL_DELTA, TYPICAL_EPSILON, acceptance_label, check_acceptance
from draftkit.inference.rejection import RejectionSampler
from draftkit.inference.sampling import SamplingParams
from draftkit.prompts import no_prompts_message, read_text_prompts, record_id, record_messages

log = logging.getLogger(__name__)

UNCATEGORIZED = "all"


@dataclass
class EvalPrompt:
    messages: list[dict] | None  # chat messages ending with the user turn, or None for raw ids
    category: str | None
    id: str
    ids: list[int] | None = None  # token ids (filled by encode, or given directly)


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def read_prompt_file(path: str | Path) -> list[EvalPrompt]:
    """Dependency-free reader for .json / .jsonl prompt files (the shapes of draftkit/prompts.py)."""
    path = Path(path)
    if path.is_dir() or (path.is_file() and path.suffix not in (".json", ".jsonl")):
        try:  # raw text (.txt/.md paragraphs, code files, a directory of them): completion prompts
            return [EvalPrompt([{"role": "user", "content": t}], None, pid) for pid, t in read_text_prompts(path)]
        except ValueError as e:
            raise SpecError(f"--prompts {path}: {e}") from e
    if not path.is_file():
        raise SpecError(f"--prompts: no such file: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text) if text.strip() else []
            records = data if isinstance(data, list) else next(
                (data[k] for k in ("data", "prompts", "train") if isinstance(data.get(k), list)), [data])
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON{'L' if path.suffix == '.jsonl' else ''}: {e}") from e
    if not records:
        raise SpecError(f"{path}: the prompt file is empty")
    prompts, unknown = [], set()
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise SpecError(f"{path}: record {i} is not a JSON object")
        messages = record_messages(r)
        if messages is None:
            unknown.update(r.keys())
            continue
        prompts.append(EvalPrompt(messages, r.get("category") or None, f"{path.stem}:{record_id(r, i)}"))
    if not prompts:
        raise SpecError(no_prompts_message(path, unknown))
    return prompts


def as_prompts(prompts) -> list[EvalPrompt]:
    """Accept EvalPrompts, distill Prompts (duck-typed), strings, message lists or token-id lists."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, EvalPrompt):
            out.append(p)
        elif hasattr(p, "messages"):
            out.append(EvalPrompt(list(p.messages), getattr(p, "category", None), str(getattr(p, "id", i))))
        elif isinstance(p, str):
            out.append(EvalPrompt([{"role": "user", "content": p}], None, str(i)))
        elif isinstance(p, dict):
            out.append(EvalPrompt(record_messages(p), p.get("category"), str(p.get("id", i))))
        elif isinstance(p, torch.Tensor) or (isinstance(p, (list, tuple)) and (not p or isinstance(p[0], int))):
            out.append(EvalPrompt(None, None, str(i), [int(t) for t in p]))
        elif isinstance(p, (list, tuple)):
            out.append(EvalPrompt(list(p), None, str(i)))
        else:
            raise SpecError(f"prompt {i}: cannot use a {type(p).__name__} as a prompt")
    return out


def encode(tokenizer, prompt: EvalPrompt) -> list[int]:
    if prompt.ids is not None:
        return prompt.ids
    if prompt.messages is None:
        raise SpecError(f"prompt {prompt.id}: no usable user turn")
    if tokenizer is None:
        raise SpecError("text prompts need a tokenizer; this target has none (pass token ids)")
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode("\n\n".join(m["content"] for m in prompt.messages))


def synthesize_prompts(target, n: int, seed: int = 0, max_tokens: int = 64,
                       progress: bool = False) -> list[EvalPrompt]:
    """Magpie: the target writes up to `n` user turns itself, with the trainer's synthesis (its
    length filters and dedupe), sampling at most 2n turns of at most `max_tokens` tokens.

    draftkit.distill is imported here, not at the top: it imports with the core dependencies
    (`datasets` only once a dataset is read), but eval with --prompts has no use for it.
    """
    from draftkit.config import SynthesisSettings
    from draftkit.distill.synthesize import synthesize_prompts as magpie

    settings = SynthesisSettings(batch_size=max(n, 1), max_new_tokens=max_tokens)
    return as_prompts(magpie(target.model, target.tokenizer, n, settings, seed=seed, max_attempts=2 * n,
                             progress=progress))


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class EvalSettings:
    """Everything `evaluate` decides besides the target, the head and the prompts (the CLI's flags).

    The main method is how `draft` drafts (hybrid, tree or chain with the head; lookup without one);
    `compare` names the methods measured beside it in the same interleaved run: "plain" (the
    baseline, and at T = 0 the reference every output must equal), "lookup" (prompt lookup alone),
    "head" (the head alone: its tree, or its chain in chain mode) and "hybrid" (head tree + lookup).
    """

    draft: DraftSettings = field(default_factory=DraftSettings)
    compare: tuple[str, ...] = ("plain", "lookup", "head", "hybrid")
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    batch_size: int = 1
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # row i samples with seed + i
    acceptance: str = "rejection"  # or "typical" (LOSSY, chain mode only): see decoder.py
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    raise_errors: bool = True  # False: a failure midway returns the report so far, status "partial"
    progress: bool = False

    def __post_init__(self):
        unknown = sorted(set(self.compare) - set(METHODS))
        if unknown:
            raise SpecError(f"compare: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")


METHODS = ("plain", "lookup", "head", "hybrid")
MAIN_OF_MODE = {"chain": "head", "tree": "head", "hybrid": "hybrid", "lookup": "lookup", "plain": "plain"}


class _Method:
    """One way of decoding (speculative with some drafter, or plain) and how to run it."""

    def __init__(self, name: str, target, drafter, decoder_kw: dict, sampler, stop_ids, acceptance: dict):
        self.name, self.target, self.stop_ids = name, target, stop_ids
        self.decoder = SpecDecoder(target, drafter, sampler=sampler, stop_ids=stop_ids, **decoder_kw,
                                   **acceptance) if drafter is not None else None
        self.k = self.decoder.k if self.decoder is not None else 0

    def run(self, ids, max_new, params, seeds, record_gaps=False):
        if self.decoder is not None:
            outs, stats = self.decoder.generate(ids, max_new, params, seeds)
            return outs, stats, None
        return plain_generate(self.target, ids, max_new, params, seeds, self.stop_ids, record_gaps)

    def fresh(self):
        return SpecStats(self.k) if self.decoder is not None else PlainStats()


def build_methods(target, head, s: EvalSettings, sampler, stop_ids) -> tuple[dict[str, _Method], str]:
    """The methods to measure (main first) and the main one's name."""
    d = s.draft
    main = MAIN_OF_MODE[d.mode] if head is not None else "lookup"
    rule = dict(acceptance=s.acceptance, typical_epsilon=s.typical_epsilon, typical_delta=s.typical_delta)
    lossless = dict(acceptance="rejection")
    names = [main] + [m for m in s.compare if m != main and (head is not None or m not in ("head", "hybrid"))]
    methods = {}
    for name in names:
        if name == "plain":
            methods[name] = _Method(name, target, None, {}, sampler, stop_ids, {})
            continue
        mode = {"lookup": "lookup", "hybrid": "hybrid", "head": "chain" if d.mode == "chain" else "tree"}[name]
        drafter, kw = replace(d, mode=mode).decoder_args(head)
        methods[name] = _Method(name, target, drafter, kw, sampler, stop_ids, rule if name == main else lossless)
    return methods, main


def evaluate(target, head, prompts, settings: EvalSettings, *, sampler: RejectionSampler | None = None,
             stop_ids: list[int] | None = None) -> dict:
    """Measure tau, alpha_i, tokens/s and speedup of the drafting in `settings` (head None: lookup
    alone) on `prompts`, beside the methods in settings.compare, interleaved batch by batch.

    prompts: EvalPrompts, distill Prompts, strings, message lists or token-id lists.
    Returns the report dict (see report.py for the keys).
    """
    t_start = time.perf_counter()
    s = settings
    if not isinstance(s, EvalSettings):
        raise SpecError(f"evaluate(): settings must be an EvalSettings, got {type(s).__name__}")
    if head is None and "lookup" not in s.compare and s.draft.mode != "lookup":
        raise SpecError("nothing to evaluate: no head and the lookup (n-gram) drafter is off")
    stop_ids = stop_token_ids(target) if stop_ids is None else list(stop_ids)
    sampler = sampler or RejectionSampler("auto")
    check_acceptance(s.acceptance, s.typical_epsilon, s.typical_delta)
    methods, main = build_methods(target, head, s, sampler, stop_ids)
    k = methods[main].k
    items, skipped = _prepare(target, as_prompts(prompts), max(m.k for m in methods.values()), s.max_new_tokens)
    if not items:
        raise SpecError(f"no prompt fits: {len(skipped)} skipped ({skipped[0]['reason'] if skipped else 'none given'})")
    temperatures = [float(t) for t in s.temperatures] or [0.0]
    report = {
        "status": "running", "error": None, "target": target.info(), "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device), "drafter": getattr(head, "family", None) if head is not None else "ngram",
        "head_config": _head_summary(head), "main": main, "draft": s.draft.to_dict(),
        "draft_description": s.draft.describe() if head is not None else replace(s.draft, mode="lookup").describe(),
        "methods_measured": list(methods), "k": k, "temperature": temperatures[0], "temperatures": temperatures,
        "top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "batch_size": s.batch_size,
        "seed": s.seed, "num_prompts": len(items), "skipped": skipped, "runs": [],
        "acceptance": acceptance_label(s.acceptance, s.typical_epsilon, s.typical_delta),
        "lossless": s.acceptance == "rejection",
        "threads": torch.get_num_threads(),
    }
    batches = _batches(items, s.batch_size)
    scorer = TeacherForced(target)  # float32 log-probs at T = 0 divergences (its copy made on first use)
    try:
        if "plain" in methods and len(methods) > 1:  # warm-up (allocator, kernels), not timed
            warm = [items[0]["ids"]]
            for m in methods.values():
                m.run(warm, min(4, s.max_new_tokens), SamplingParams(), [0])
        for T in temperatures:
            params = SamplingParams(T, s.top_k, s.top_p)
            run = {"temperature": T, "done_prompts": 0}
            report["runs"].append(run)
            totals = {name: m.fresh() for name, m in methods.items()}
            per_cat: dict[str, dict] = {}
            outputs: dict[str, dict[int, list[int]]] = {name: {} for name in methods}
            gaps: dict[int, list] = {}
            for bi, batch in enumerate(batches):
                ids = [it["ids"] for it in batch]
                seeds = [s.seed + it["index"] for it in batch]
                names = list(methods)
                names = names[bi % len(names):] + names[: bi % len(names)]  # interleave the order
                cat = batch[0]["category"]
                cat_stats = per_cat.setdefault(cat, {n: methods[n].fresh() for n in methods} | {"num_prompts": 0})
                for name in names:
                    want_gaps = name == "plain" and T == 0.0
                    outs, stats, g = methods[name].run(ids, s.max_new_tokens, params, seeds, want_gaps)
                    totals[name] += stats
                    cat_stats[name] += stats
                    for it, o in zip(batch, outs):
                        outputs[name][it["index"]] = o
                    if g is not None:
                        gaps.update({it["index"]: gg for it, gg in zip(batch, g)})
                cat_stats["num_prompts"] += len(batch)
                run["done_prompts"] += len(batch)
                _fill_run(run, totals, per_cat, outputs, gaps, items, scorer, main)
                if s.progress:
                    print(f"  T={T:g}: {run['done_prompts']}/{len(items)} prompts, " + ", ".join(
                        f"{n} tau={(run['methods'].get(n) or {}).get('tau') or 0:.2f}" for n in methods if n != "plain"),
                        file=sys.stderr, flush=True)
        report["status"] = "complete"
    except (Exception, KeyboardInterrupt) as e:
        if s.raise_errors:
            raise
        report["status"] = "partial"
        report["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        log.error("evaluation stopped midway: %s", report["error"])
    report.update({key: val for key, val in (report["runs"][0] if report["runs"] else {}).items()
                   if key not in ("temperature", "done_prompts")})
    greedy_run = next((r for r in report["runs"] if r["temperature"] == 0.0), None)
    if greedy_run is not None:  # the equality check lives in the T = 0 run, whichever comes first
        report.update({key: val for key, val in greedy_run.items() if "greedy" in key})
    report["seconds"] = time.perf_counter() - t_start
    return report


def _prepare(target, prompts: list[EvalPrompt], k: int, max_new_tokens: int) -> tuple[list[dict], list[dict]]:
    """Tokenize; prompts that are empty or do not fit the context are skipped with a reason."""
    ctx = context_length(target)
    items, skipped = [], []
    for i, p in enumerate(prompts):
        try:
            ids = encode(target.tokenizer, p)
        except SpecError as e:
            skipped.append({"id": p.id, "reason": str(e)})
            continue
        if not ids:
            skipped.append({"id": p.id, "reason": "empty prompt"})
        elif len(ids) + max_new_tokens + k + 1 > ctx:
            skipped.append({"id": p.id, "reason": f"too long: {len(ids)} prompt tokens + max_new_tokens "
                                                 f"{max_new_tokens} + k+1 {k + 1} > context {ctx}"})
        else:
            items.append({"index": i, "id": p.id, "category": p.category or UNCATEGORIZED, "ids": ids})
    for s in skipped:
        log.warning("skipping prompt %s: %s", s["id"], s["reason"])
    return items, skipped


def _batches(items: list[dict], batch_size: int) -> list[list[dict]]:
    """Batches of one category each (so per-category stats are exact), similar lengths together."""
    if batch_size < 1:
        raise SpecError(f"batch_size must be >= 1, got {batch_size}")
    by_cat: dict[str, list[dict]] = {}
    for it in items:
        by_cat.setdefault(it["category"], []).append(it)
    out = []
    for group in by_cat.values():
        group = sorted(group, key=lambda it: len(it["ids"])) if batch_size > 1 else group
        out += [group[i: i + batch_size] for i in range(0, len(group), batch_size)]
    return out


SUMMARY_KEYS = ("tau", "acceptance_per_position", "accepted_length_histogram", "accepted_by_source", "tokens_per_s",
                "draft_ms_per_step", "verify_ms_per_step", "draft_s", "verify_s", "prefill_s", "steps", "row_steps",
                "new_tokens")


def _method_summary(stats, plain) -> dict:
    d = stats.to_dict()
    out = {key: d[key] for key in SUMMARY_KEYS}
    out["speedup"] = stats.tokens_per_s / plain.tokens_per_s if plain is not None and plain.tokens_per_s else None
    return out


def _summary(totals: dict, main: str) -> dict:
    """The main method's numbers at the top, every speculative method under "methods", the
    lookup baseline also under its historical key "ngram"."""
    plain = totals.get("plain")
    methods = {name: _method_summary(st, plain) for name, st in totals.items()
               if name != "plain" and not isinstance(st, (int, PlainStats))}
    s: dict = dict(methods.get(main, {}))
    if main == "plain" and plain is not None:  # plain decoding chosen: one token per forward, by definition
        s.update(tau=1.0, tokens_per_s=plain.tokens_per_s, speedup=1.0)
    if plain is not None:
        s.update(baseline_tokens_per_s=plain.tokens_per_s, plain_ms_per_step=1e3 * plain.total_s / max(plain.steps, 1))
    else:
        s.update(baseline_tokens_per_s=None, speedup=None)
    s["methods"] = methods
    if "lookup" in methods and main != "lookup":
        s["ngram"] = methods["lookup"]
    return s


def _fill_run(run, totals, per_cat, outputs, gaps, items, scorer, main) -> None:
    run.update(_summary(totals, main))
    run["per_category"] = {cat: {"num_prompts": st["num_prompts"], **_summary(st, main)} for cat, st in per_cat.items()}
    if run["temperature"] == 0.0 and "plain" in outputs:
        done = [it for it in items if it["index"] in outputs["plain"]]
        ref = [outputs["plain"][it["index"]] for it in done]
        pids = [it["id"] for it in done]
        for name in outputs:
            if name == "plain":
                continue
            cmp = compare_greedy([outputs[name][it["index"]] for it in done], ref, [it["ids"] for it in done],
                                 scorer, pids)
            prefix = "greedy" if name == main else ("ngram_greedy" if name == "lookup" else f"{name}_greedy")
            run[f"{prefix}_mismatches"] = cmp["mismatches"]
            run[f"{prefix}_near_ties"] = cmp["near_ties"]
            run[f"{prefix}_divergences"] = cmp["divergences"]
            run[f"{prefix}_max_gap"], run[f"{prefix}_tie_gap"] = cmp["max_gap"], cmp["tolerance"]
            run[f"{prefix}_failures"] = cmp["failures"]  # divergences outside the gap: a bug when lossless
            run["methods"][name]["greedy_mismatches"] = cmp["mismatches"]
            run["methods"][name]["greedy_near_ties"] = cmp["near_ties"]
    else:
        run.setdefault("greedy_mismatches", None)


def _head_summary(head) -> dict | None:
    if head is None or not hasattr(head, "config"):
        return None
    c = head.config
    return {"family": getattr(head, "family", None), "target": getattr(c, "target", None),
            "feature_layers": list(getattr(head, "feature_layers", ())),
            "num_layers": getattr(c, "num_layers", None)}
