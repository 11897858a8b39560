"""`draftkit eval` command line: flags -> EvalSettings, the head and target loaded, calibration when
the draft shape is not known, `evaluate()` (draftkit/inference/evaluate.py), and the report written.

    draftkit eval --head runs/eagle/head --prompts prompts.jsonl --k 5 --temperature 0 0.7 --out runs/eval
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from draftkit.inference.calibrate import add_arguments as add_calibration_arguments, calibrate
from draftkit.inference.errors import SpecError
from draftkit.inference.typical import ACCEPTANCE_RULES, TYPICAL_DELTA, TYPICAL_EPSILON, check_acceptance
from draftkit.inference.drafters import MODES, DraftSettings, DraftSettingsError
from draftkit.inference.evaluate import METHODS, EvalPrompt, EvalSettings, evaluate, read_prompt_file, synthesize_prompts
from draftkit.inference.rejection import RejectionSampler


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", help="head directory (<output_dir>/head, or the output_dir itself); "
                                  "without it only prompt lookup (n-gram) is measured")
    p.add_argument("--target", help="target model dir / .gguf / hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--prompts", nargs="+", help=".json/.jsonl prompt files, or raw text for base models (.txt/.md: "
                                                "one prompt per paragraph; code files; directories); default: "
                                                "prompts synthesized by the target (needs a chat template)")
    p.add_argument("--draft", default="auto", choices=["auto", "calibrate", *MODES],
                   help="how the head drafts: auto (default) = the head config's `draft:` section, measured and "
                        "written there on first use; calibrate = measure again; chain | tree | hybrid | lookup = "
                        "that mode with the flags below (unset flags from the config's section or the defaults)")
    p.add_argument("--k", type=int, help="chain length (chain mode; --draft chain is implied by --k alone)")
    p.add_argument("--tree-topk", type=int, help="tree: children per expanded node and frontier width")
    p.add_argument("--tree-depth", type=int, help="tree: levels")
    p.add_argument("--tree-budget", type=int, help="tree: nodes kept (the verify forward feeds budget+1 tokens)")
    p.add_argument("--lookup-len", type=int, help="lookup branch (hybrid) / chain (lookup) length")
    p.add_argument("--head-off-at", type=int, help="hybrid: a lookup proposal this long skips the head's tree")
    p.add_argument("--compare", nargs="*", default=list(METHODS), choices=list(METHODS),
                   help="methods measured beside the main one, interleaved (default: all: plain lookup head hybrid)")
    p.add_argument("--calibration-prompts", type=int, default=4,
                   help="auto/calibrate: prompts (the first of the list) the cost model runs on (default 4)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--limit", type=int, help="evaluate at most N prompts (the first N of the files)")
    p.add_argument("--num-synthesized", type=int, default=16, help="prompts to synthesize without --prompts")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="row i samples with seed + i")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="rejection sampler")
    p.add_argument("--acceptance", default="rejection", choices=list(ACCEPTANCE_RULES),
                   help="verify rule: rejection = lossless rejection sampling (default); typical = Medusa's "
                        "typical acceptance, LOSSY (chain mode only; more tokens accepted, output no longer "
                        "the target's distribution at T > 0); the report names it")
    p.add_argument("--typical-epsilon", type=float, default=TYPICAL_EPSILON,
                   help=f"typical acceptance: probability floor epsilon (default {TYPICAL_EPSILON})")
    p.add_argument("--typical-delta", type=float, default=TYPICAL_DELTA,
                   help=f"typical acceptance: entropy-scaled bar delta (default {TYPICAL_DELTA})")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no equality check)")
    p.add_argument("--no-ngram", action="store_true", help="skip the prompt-lookup baseline")
    p.add_argument("--ngram-n", type=int, default=3, help="longest n-gram the lookup drafter matches")
    p.add_argument("--force", action="store_true", help="use a head whose recorded target does not match")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="runs/eval", help="directory for report.json, report.md, acceptance.png")
    add_calibration_arguments(p)
    from draftkit.engines.vllm_eval import add_arguments as add_engine_arguments
    add_engine_arguments(p)  # --engine vllm, --vllm-python


def resolve_head_dir(path: str) -> Path:
    d = Path(path)
    if (d / "head" / "config.json").is_file() and not (d / "config.json").is_file():
        return d / "head"
    return d


def draft_from_flags(args, saved: dict | None) -> tuple[DraftSettings, bool]:
    """DraftSettings from --draft and the size flags on top of the head's saved `draft:` section.
    Returns (settings, needs_measuring)."""
    flags = {"k": args.k, "topk": args.tree_topk, "depth": args.tree_depth, "budget": args.tree_budget,
             "lookup_len": args.lookup_len, "head_off_at": args.head_off_at, "lookup_ngram": args.ngram_n}
    given = {key: v for key, v in flags.items() if v is not None and not (key == "lookup_ngram" and v == 3)}
    mode = args.draft
    if mode == "auto" and set(given) == {"k"}:
        mode = "chain"  # `--k 4` alone keeps its old meaning: a chain of 4
    base = DraftSettings.from_dict(saved, "config.json draft") if saved else DraftSettings()
    if mode in MODES:
        return replace(base, mode=mode, chosen_by="user", measured={}, **given), False
    if mode == "auto" and saved and not given:
        return base, False
    return replace(base, **given), True


def run(args) -> int:
    from draftkit.heads.base import HeadError, load_head, read_head_config
    from draftkit.inference.report import format_table, write_report
    from draftkit.target import TargetError, load_target

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "engine", "draftkit") == "vllm":
        from draftkit.engines.vllm_eval import run_cli
        return run_cli(args)
    try:
        if args.k is not None and args.k < 1:
            raise SpecError(f"--k must be >= 1, got {args.k}")
        check_acceptance(args.acceptance, args.typical_epsilon, args.typical_delta)
        prompts: list[EvalPrompt] = []
        for f in args.prompts or []:
            prompts += read_prompt_file(f)
        target = load_target(args.target, dtype=args.dtype, device=args.device)
        head, saved = None, None
        if args.head:
            head_dir = resolve_head_dir(args.head)
            head = load_head(head_dir, target, strict_target=not args.force)
            head.to(dtype=target.dtype).eval()
            saved = read_head_config(head_dir).get("draft")
        draft, measure = draft_from_flags(args, saved)
        if args.acceptance == "typical" and draft.mode != "chain":
            draft = replace(draft, mode="chain", chosen_by="user (typical acceptance is chain-only)")
            measure = False
        if not args.prompts:
            print(f"no --prompts: synthesizing {args.num_synthesized} prompts with the target", file=sys.stderr)
            try:
                prompts = synthesize_prompts(target, args.num_synthesized, args.seed, progress=True)
            except ValueError as e:  # a base model has no chat template: Magpie cannot run
                raise SpecError(str(e)) from e
            if not prompts:
                raise SpecError("the target synthesized no usable prompts; pass --prompts FILE")
        if args.limit is not None:
            prompts = prompts[: args.limit]
        settings = EvalSettings(
            draft=draft, compare=tuple(m for m in args.compare if not (args.no_baseline and m == "plain")
                                       and not (args.no_ngram and m == "lookup")),
            temperatures=tuple(args.temperature), max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, acceptance=args.acceptance,
            typical_epsilon=args.typical_epsilon, typical_delta=args.typical_delta, raise_errors=False, progress=True)
    except (SpecError, HeadError, TargetError, DraftSettingsError) as e:
        print(f"draftkit eval: error: {e}", file=sys.stderr)
        return 2
    if head is not None and measure:
        settings = replace(settings, draft=calibrate(target, head, prompts, settings, args.calibration_prompts,
                                                     args.calibration_budget))
        write_draft_section(head_dir, settings.draft)
        print(f"wrote the choice to {head_dir / 'config.json'} (draft:); --draft MODE and the size flags override it",
              file=sys.stderr)
    out = Path(args.out)
    try:
        report = evaluate(target, head, prompts, settings, sampler=RejectionSampler(args.backend))
    except (SpecError, ValueError) as e:
        print(f"draftkit eval: error: {e}", file=sys.stderr)
        return 2
    report["head_dir"] = str(resolve_head_dir(args.head)) if args.head else None
    report["prompt_files"] = args.prompts
    paths = write_report(report, out)
    print(format_table(report))
    if not report["lossless"]:
        print(f"note: acceptance {report['acceptance']}: the output is not the target's distribution at T > 0; "
              "T = 0 mismatches are reported, not a bug", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths))
    if report["status"] != "complete":
        print(f"draftkit eval: stopped midway ({report['error']}); the partial report covers what finished",
              file=sys.stderr)
        return 1
    return 0


def write_draft_section(head_dir: Path, draft: DraftSettings) -> None:
    """Set `draft:` in the head's config.json, atomically (a crash leaves the previous file)."""
    from draftkit.inference.report import _atomic_write

    path = Path(head_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["draft"] = draft.to_dict()
    _atomic_write(path, json.dumps(cfg, indent=2, default=str))
