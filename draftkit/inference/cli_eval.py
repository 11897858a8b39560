"""`draftkit eval` command line: flags -> EvalSettings, the head and target loaded, the draft shape
decided (flags, a saved choice, or calibration), `evaluate()` (draftkit/inference/evaluate.py), and
the report written.

    draftkit eval --head runs/eagle/head --prompts prompts.jsonl --k 5 --temperature 0 0.7 --out runs/eval

Where the draft shape comes from (first that applies; `report.json` names it as `draft_source`):
  1. --draft chain|tree|hybrid|lookup: that mode; the size flags given are kept exactly, the others
     come from the sources below (without calibrating) or DraftSettings' defaults.
  2. size flags without --draft imply the mode: --k => chain; --tree-topk/--tree-depth/--tree-budget
     => tree; --lookup-len/--head-off-at (with or without --tree-*) => hybrid. (--ngram-n implies no
     mode.) Nothing is measured.
  3. --draft calibrate: measure now, searching only the shapes that have the size flags' values and
     the mode they imply (the printed prediction is the shape that runs); --k fixes a whole chain,
     so it leaves nothing to measure.
  4. --draft auto (default): --draft-from FILE|DIR; else the head's config.json `draft:` (written
     only by --save-draft, or an older draftkit); else the choice a previous calibration left in
     --out/draft.json for the same head, target, dtype and device; else measure now.
Eval never writes into the head directory unless --save-draft asks (a read-only hub snapshot
works). A measured choice goes to --out/draft.json: the shape *draftkit's own loop* runs fastest
on this machine, not the shape an engine should serve (that is the export contract's business).
Beside it, a measurement with nothing fixed records `engine_draft.sglang` (export/serving.py:
sglang_from_calibration): the best SGLang-valid tree of the same calibration's ranking, under
SGLang's rule, labelled not engine-measured; --save-draft writes it into the head's config.json
too (keeping a vLLM choice there), so `draftkit export` carries it and `draftkit inspect` prints
its SGLang flags. A shape reused as is (--draft-from, the head's draft:, --out/draft.json) brings the
SGLang record kept beside it (reused_sglang) into the report and, with --save-draft, the head;
report.json's `engine_draft_source` names where it came from.

Dtype (--dtype): the target loads in the batched stages' dtype and synthesizes prompts in it; then
eval switches to the decode stage's (draftkit/device.py: under auto on a CPU without native bf16 a
short measurement decides; the target is cast, and the log says so) before the draft shape is
decided, so a saved or measured shape is the one for the dtype the loop runs. report.json:
`dtype` (the loop's), `dtype_choice` (why), `dtype_stages` (per stage, measurement, CPU flags).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from draftkit.inference.calibrate import (CALIBRATION_PROMPTS, MAX_CALIBRATION_TOKENS, calibrate,
                                         add_arguments as add_calibration_arguments)
from draftkit.export.serving import ENGINE_DRAFT_KEY, sglang_from_calibration, sglang_summary
from draftkit.inference.cost import FIXABLE, PAYS, SearchSpace
from draftkit.inference.errors import SpecError
from draftkit.inference.typical import ACCEPTANCE_RULES, TYPICAL_DELTA, TYPICAL_EPSILON, check_acceptance
from draftkit.inference.drafters import MODES, DraftSettings, DraftSettingsError
from draftkit.inference.evaluate import METHODS, EvalPrompt, EvalSettings, evaluate, read_prompt_file, synthesize_prompts
from draftkit.inference.rejection import RejectionSampler
from draftkit.device import DECODE_MARGIN, use_decode_dtype
from draftkit.target import AUTO_DTYPE, DTYPES

DRAFT_FILE = "draft.json"
DRAFT_FILE_ABOUT = ("the draft shape draftkit's own draft-verify loop measured fastest on this machine "
                    "(draftkit eval --draft auto|calibrate); not the shape a serving engine should use")
# size flag (argparse dest) -> DraftSettings field
SIZE_FLAGS = {"k": "k", "tree_topk": "topk", "tree_depth": "depth", "tree_budget": "budget",
              "lookup_len": "lookup_len", "head_off_at": "head_off_at", "ngram_n": "lookup_ngram"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default after its help; an unset (None) default says "unset: <what rules then>"."""

    def _get_help_string(self, action):
        if action.default is None and action.option_strings:  # the help says what unset means, or says unset
            return action.help if "unset" in (action.help or "") else (action.help or "") + " (default: unset)"
        return super()._get_help_string(action)


HELP_FORMATTER = HelpFormatter  # draftkit/cli.py builds `draftkit eval`'s parser with it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", help="head directory (<output_dir>/head, or the output_dir itself); "
                                  "unset: only prompt lookup (n-gram) is measured")
    p.add_argument("--target", help="target model dir / .gguf / hub id; unset: the embedded SmolLM2-135M")
    p.add_argument("--prompts", nargs="+", help=".json/.jsonl prompt files, or raw text for base models (.txt/.md: "
                                                "one prompt per paragraph; code files; directories); unset: "
                                                "prompts synthesized by the target (needs a chat template)")
    _draft_arguments(p)
    _sampling_arguments(p)
    p.add_argument("--limit", type=int, help="evaluate at most N prompts (the first N of the files); unset: all")
    p.add_argument("--num-synthesized", type=int, default=16, help="prompts to synthesize without --prompts")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
                   help="target and head dtype; auto = bfloat16 where the device multiplies bf16 natively (CUDA "
                        "with bf16, a CPU with AVX512-BF16 or AMX), else float32 for prompt synthesis and, for the "
                        "decoding loop, bfloat16 only where a short measurement finds it "
                        f"{DECODE_MARGIN * 100:.0f}%% faster at a one-token step, a verify and a prefill "
                        "(draftkit/device.py); the choice per stage is printed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--seed", type=int, default=0, help="row i samples with seed + i")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="rejection sampler kernels")
    p.add_argument("--force", action="store_true", help="use a head whose recorded target does not match")
    p.add_argument("--threads", type=int, help="torch CPU threads; unset: torch's default")
    p.add_argument("--out", default="runs/eval",
                   help="directory for report.json, report.md, acceptance.png (and draft.json when measured)")


def _draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="auto", choices=["auto", "calibrate", *MODES],
                   help="how the head drafts: auto = a saved choice (--draft-from, the head's config.json draft:, "
                        "--out/draft.json for this head), else measured now; calibrate = measure again; chain | "
                        "tree | hybrid | lookup = that mode. Size flags alone imply the mode (--k: chain, --tree-*: "
                        "tree, --lookup-len/--head-off-at: hybrid) and are never overwritten or measured")
    p.add_argument("--draft-from", metavar="PATH",
                   help="auto: reuse the draft shape of an earlier eval (its draft.json or report.json, or its "
                        "--out directory)")
    p.add_argument("--save-draft", action="store_true",
                   help="also write the draft shape used into the head's config.json (draft:), atomically; "
                        "without it eval never writes into the head directory")
    p.add_argument("--k", type=int, help="chain drafting: chain length (implies --draft chain); unset: from the saved choice or 4")
    p.add_argument("--tree-topk", type=int, help="tree drafting: children per expanded node and frontier width "
                                                 "(implies --draft tree)")
    p.add_argument("--tree-depth", type=int, help="tree drafting: levels (implies --draft tree)")
    p.add_argument("--tree-budget", type=int, help="tree drafting: nodes kept; the verify forward feeds budget+1 "
                                                   "tokens (implies --draft tree)")
    p.add_argument("--lookup-len", type=int, help="prompt lookup: branch length in hybrid, chain length in lookup "
                                                  "mode (implies --draft hybrid unless --k is given)")
    p.add_argument("--head-off-at", type=int, help="hybrid drafting: a lookup proposal this long skips the head's "
                                                   "tree (implies --draft hybrid)")
    p.add_argument("--ngram-n", type=int, help="prompt lookup: longest n-gram matched; unset: the saved choice's "
                                               f"or {DraftSettings.lookup_ngram}")
    p.add_argument("--compare", nargs="*", choices=["all", "none", *METHODS], metavar="METHOD",
                   help="methods measured beside the main one, interleaved: any of " + " ".join(METHODS)
                        + "; `--compare` alone or `all` = all of them, `none` = only the main one; unset: all")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no equality check)")
    p.add_argument("--no-ngram", action="store_true", help="skip the prompt-lookup baseline")
    from draftkit.engines.vllm_auto import ENGINE_CALIBRATION_PROMPTS
    p.add_argument("--calibration-prompts", type=int, default=None, metavar="N",
                   help="auto/calibrate: how many prompts the cost model measures on, spread evenly over the "
                        "prompt list (after --limit), in turn from each category; they are evaluated with the "
                        f"others too (default {CALIBRATION_PROMPTS} for our loop, {ENGINE_CALIBRATION_PROMPTS} for "
                        "--engine vllm's sweep, which builds an engine per candidate)")
    add_calibration_arguments(p)
    from draftkit.engines.vllm_eval import add_arguments as add_engine_arguments
    add_engine_arguments(p)  # --engine vllm, --vllm-python


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                   help="sampling: one or more temperatures, each a run; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus, smallest set of mass >= p (1 = off)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--acceptance", default="rejection", choices=list(ACCEPTANCE_RULES),
                   help="verify rule: rejection = lossless rejection sampling; typical = Medusa's typical "
                        "acceptance, LOSSY (chain mode only; more tokens accepted, output no longer the "
                        "target's distribution at T > 0); the report names it")
    p.add_argument("--typical-epsilon", type=float, default=TYPICAL_EPSILON,
                   help="typical acceptance: probability floor epsilon")
    p.add_argument("--typical-delta", type=float, default=TYPICAL_DELTA,
                   help="typical acceptance: entropy-scaled bar delta")


def resolve_head_dir(path: str) -> Path:
    d = Path(path)
    if (d / "head" / "config.json").is_file() and not (d / "config.json").is_file():
        return d / "head"
    return d


def compare_methods(args) -> tuple[str, ...]:
    """--compare: unset, alone or `all` = every method; `none` = nothing beside the main one."""
    chosen = args.compare
    if chosen is None or chosen == [] or chosen == ["all"]:
        chosen = list(METHODS)
    elif "none" in chosen or "all" in chosen:
        if len(chosen) > 1:
            raise SpecError(f"--compare: `none` and `all` stand alone, got {' '.join(chosen)}")
        chosen = []
    return tuple(m for m in chosen if not (args.no_baseline and m == "plain") and not (args.no_ngram and m == "lookup"))


# ---------------------------------------------------------------------------------------------
# The draft shape: flags first, then a saved choice, then calibration (the module doc's order)
# ---------------------------------------------------------------------------------------------


def given_sizes(args) -> dict:
    """The size flags the user gave, as DraftSettings fields (argparse leaves the others None)."""
    return {field: getattr(args, flag) for flag, field in SIZE_FLAGS.items() if getattr(args, flag) is not None}


def implied_mode(given: dict) -> str | None:
    """The mode the size flags imply: --k chain, --tree-* tree, --lookup-len/--head-off-at hybrid."""
    tree = given.keys() & {"topk", "depth", "budget"}
    if "k" in given:
        others = sorted(tree | (given.keys() & {"head_off_at"}))
        if others:
            raise DraftSettingsError(f"--k is a chain's length but {', '.join(others)} belong to a tree: say which "
                                     "with --draft chain|tree|hybrid")
        return "chain"
    if given.keys() & {"lookup_len", "head_off_at"}:
        return "hybrid"
    return "tree" if tree else None


def draft_from_flags(args, saved: DraftSettings | None) -> tuple[DraftSettings, bool]:
    """(settings, needs_measuring) from --draft and the size flags over `saved` (the choice --draft
    auto found, or None). The flags given are kept exactly; calibration searches only the rest
    (search_space), and a chain (--k) has no rest."""
    given = given_sizes(args)
    mode = args.draft if args.draft in MODES else implied_mode(given)
    base = saved or DraftSettings()
    if mode is not None and (args.draft != "calibrate" or mode == "chain"):
        return replace(base, mode=mode, chosen_by="user", measured={}, **given), False
    if args.draft == "auto" and saved is not None:
        return replace(base, **given), False
    return replace(base, **given), True


def search_space(args) -> SearchSpace:
    """What calibration may choose: the size flags given fix their fields, and the mode they imply
    (tree or hybrid) fixes the kind; --ngram-n is already in the base settings (the traces use it)."""
    given = {k: v for k, v in given_sizes(args).items() if k in FIXABLE}
    return SearchSpace(fixed=given, mode=implied_mode(given_sizes(args)))


def read_draft_file(path: str | Path) -> dict:
    """The `draft` record of an earlier eval: its draft.json, its report.json, or its --out directory."""
    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in (DRAFT_FILE, "report.json") if (p / n).is_file()), p / DRAFT_FILE)
    if not p.is_file():
        raise DraftSettingsError(f"--draft-from {path}: no such file (expected a draft.json, a report.json or "
                                 "an eval --out directory holding one)")
    try:
        record = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DraftSettingsError(f"{p}: not valid JSON: {e}") from e
    if not isinstance(record, dict) or not isinstance(record.get("draft"), dict):
        raise DraftSettingsError(f"{p}: no `draft` object (expected draftkit eval's draft.json or report.json)")
    DraftSettings.from_dict(record["draft"], f"{p} draft")  # a clear error now, naming the file and field
    return {**record, "path": str(p)}


def draft_record(draft: DraftSettings, head_dir: Path, target, sglang: dict | None = None) -> dict:
    """What draft.json holds: the choice and what it was measured for (and SGLang's tree from the
    same calibration, when recorded)."""
    rec = {"about": DRAFT_FILE_ABOUT, "draft": draft.to_dict(), "head_dir": str(Path(head_dir).resolve()),
           "target": {"name": target.name, "fingerprint": target.fingerprint},
           "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device),
           "threads": torch.get_num_threads()}
    return {**rec, ENGINE_DRAFT_KEY: {"sglang": sglang}} if sglang else rec


def loop_sglang(cal, head, target, settings: EvalSettings, space: SearchSpace) -> dict | None:
    """engine_draft.sglang from this eval's calibration: only when nothing was fixed (a narrowed
    search ranks only some trees), and only for a family SGLang serves (else None)."""
    if not space.any_mode:
        return None
    return sglang_from_calibration(cal, head.family, target, PAYS,
                                   min(MAX_CALIBRATION_TOKENS, settings.max_new_tokens))


def same_setup(record: dict, head_dir: Path, target) -> bool:
    """Whether an earlier eval's record (draft.json or report.json) was for this head, target
    (by fingerprint), dtype and device."""
    def setup(rec):
        return (str(Path(rec["head_dir"]).resolve()) if rec.get("head_dir") else None,
                (rec.get("target") or {}).get("fingerprint"), rec.get("dtype"), rec.get("device"))
    return setup(record) == setup(draft_record(DraftSettings(), head_dir, target))


def saved_choice(args, head_dir: Path, head_cfg: dict, target) -> tuple[DraftSettings | None, str]:
    """--draft auto's saved choice, in the module doc's order, and where it came from."""
    if args.draft_from:
        rec = read_draft_file(args.draft_from)
        if rec.get("head_dir") and not same_setup(rec, head_dir, target):
            print(f"note: {rec['path']} was measured for another head, target, dtype or device; used as asked",
                  file=sys.stderr)
        return DraftSettings.from_dict(rec["draft"], f"{rec['path']} draft"), rec["path"]
    if head_cfg.get("draft"):
        return DraftSettings.from_dict(head_cfg["draft"], "config.json draft"), str(head_dir / "config.json")
    previous = Path(args.out) / DRAFT_FILE
    if previous.is_file():
        rec = read_draft_file(previous)
        if same_setup(rec, head_dir, target):
            return DraftSettings.from_dict(rec["draft"], f"{previous} draft"), str(previous)
        print(f"note: {previous} was measured for another head, target, dtype or device: measuring again",
              file=sys.stderr)
    return None, "none"


def reused_sglang(source: str, head_dir: Path | None, head_cfg: dict) -> dict | None:
    """engine_draft.sglang kept beside the draft shape eval reuses as is (source: the saved choice's
    path, from saved_choice): the head's config.json's, or that draft.json's / report.json's; None
    for any other source (flags, defaults, measured)."""
    if head_dir is not None and source == str(Path(head_dir) / "config.json"):
        return (head_cfg.get(ENGINE_DRAFT_KEY) or {}).get("sglang")
    if not (source.endswith(".json") and Path(source).is_file()):  # a draft.json / report.json, not "flags ..."
        return None
    return (read_draft_file(source).get(ENGINE_DRAFT_KEY) or {}).get("sglang")


def decide_draft(args, head, head_dir, head_cfg, target) -> tuple[DraftSettings, str, bool]:
    """(settings, draft_source, needs_measuring) for the head (None: lookup alone, never measured)."""
    saved, source = (None, "none")
    if head is not None and args.draft in ("auto", *MODES):
        saved, source = saved_choice(args, head_dir, head_cfg, target)
    draft, measure = draft_from_flags(args, saved)
    mode = implied_mode(given_sizes(args))
    from_flags = args.draft in MODES or (args.draft == "auto" and mode is not None) or mode == "chain"
    if args.acceptance == "typical" and draft.mode != "chain":
        if from_flags:
            raise SpecError(f"--acceptance typical is chain-only; the flags ask for {draft.mode} (use --draft chain)")
        draft = replace(draft, mode="chain", chosen_by="user (typical acceptance is chain-only)")
        return draft, "--acceptance typical (chain-only)", False
    if head is None:
        return draft, "flags" if given_sizes(args) else "defaults: no head, lookup alone", False
    if from_flags and args.draft == "calibrate":
        return draft, "flags (--k fixes the whole chain: nothing to calibrate)", False
    if from_flags:
        return draft, f"flags (unset sizes from {source})" if saved else "flags", False
    return draft, source, measure


def write_head_draft(head_dir: Path, draft: DraftSettings, out: Path, sglang: dict | None = None) -> Path:
    """--save-draft: set `draft:` in the head's config.json (and engine_draft.sglang when this eval
    measured one, beside any vLLM choice there), atomically (a crash leaves the old file)."""
    from draftkit.inference.report import atomic_write

    path = Path(head_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["draft"] = draft.to_dict()
    if sglang:
        cfg[ENGINE_DRAFT_KEY] = {**(cfg.get(ENGINE_DRAFT_KEY) or {}), "sglang": sglang}
    try:
        return atomic_write(path, json.dumps(cfg, indent=2, default=str))
    except OSError as e:
        raise SpecError(f"--save-draft: cannot write {path}: {e.strerror or e} (a read-only head directory, e.g. a "
                        f"hub snapshot? copy it, or reuse the choice with --draft-from {out})") from e


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def load_everything(args):
    """(target, head, head_dir, head config, prompts before synthesis)."""
    from draftkit.heads.base import load_head, read_head_config
    from draftkit.target import load_target

    if args.k is not None and args.k < 1:
        raise SpecError(f"--k must be >= 1, got {args.k}")
    if args.calibration_prompts is not None and args.calibration_prompts < 1:
        raise SpecError(f"--calibration-prompts must be >= 1, got {args.calibration_prompts}")
    check_acceptance(args.acceptance, args.typical_epsilon, args.typical_delta)
    prompts: list[EvalPrompt] = []
    for f in args.prompts or []:
        prompts += read_prompt_file(f)
    target = load_target(args.target, dtype=args.dtype, device=args.device)  # logs its dtype choice
    head, head_dir, head_cfg = None, None, {}
    if args.head:
        head_dir = resolve_head_dir(args.head)
        head = load_head(head_dir, target, strict_target=not args.force)
        head.to(dtype=target.dtype).eval()
        head_cfg = read_head_config(head_dir)
    return target, head, head_dir, head_cfg, prompts


def eval_prompts(args, target, prompts: list[EvalPrompt]) -> list[EvalPrompt]:
    if not args.prompts:
        print(f"no --prompts: synthesizing {args.num_synthesized} prompts with the target", file=sys.stderr)
        try:
            prompts = synthesize_prompts(target, args.num_synthesized, args.seed, progress=True)
        except ValueError as e:  # a base model has no chat template: Magpie cannot run
            raise SpecError(str(e)) from e
        if not prompts:
            raise SpecError("the target synthesized no usable prompts; pass --prompts FILE")
    return prompts[: args.limit] if args.limit is not None else prompts


def run(args) -> int:
    from draftkit.heads.base import HeadError
    from draftkit.inference.report import atomic_write, format_table, write_report
    from draftkit.target import TargetError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "engine", "draftkit") == "vllm":
        from draftkit.engines.vllm_eval import run_cli
        return run_cli(args)
    out, sglang, sglang_source = Path(args.out), None, None
    try:
        target, head, head_dir, head_cfg, prompts = load_everything(args)
        prompts = eval_prompts(args, target, prompts)  # synthesis (batched) in the dtype loaded
        stages = use_decode_dtype(args.dtype, target, head)  # the rest decodes: its dtype from here on
        draft, source, measure = decide_draft(args, head, head_dir, head_cfg, target)
        settings = EvalSettings(
            draft=draft, compare=compare_methods(args), temperatures=tuple(args.temperature),
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, acceptance=args.acceptance, typical_epsilon=args.typical_epsilon,
            typical_delta=args.typical_delta, raise_errors=False, progress=True)
        if measure:
            space = search_space(args)
            n = CALIBRATION_PROMPTS if args.calibration_prompts is None else args.calibration_prompts
            draft, cal = calibrate(target, head, prompts, settings, n, args.calibration_budget, space=space)
            settings, source = replace(settings, draft=draft), f"measured now (written to {out / DRAFT_FILE})"
            sglang, sglang_source = loop_sglang(cal, head, target, settings, space), source
            if sglang:
                print(sglang_summary(sglang), file=sys.stderr)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write(out / DRAFT_FILE, json.dumps(draft_record(draft, head_dir, target, sglang), indent=2,
                                                      default=str))
        elif head is not None:  # a reused shape brings the SGLang record kept beside it
            sglang, sglang_source = reused_sglang(source, head_dir, head_cfg), source
            if sglang:
                print(f"engine draft: SGLang's record from {source}", file=sys.stderr)
        print(f"draft: {draft.describe() if head is not None else 'lookup'} (from {source})", file=sys.stderr)
        if args.save_draft:
            if head is None:
                raise SpecError("--save-draft needs --head")
            path = write_head_draft(head_dir, draft, out, sglang)
            print(f"wrote the draft shape to {path} (draft:{' and engine_draft.sglang' if sglang else ''})",
                  file=sys.stderr)
    except (SpecError, HeadError, TargetError, DraftSettingsError) as e:
        print(f"draftkit eval: error: {e}", file=sys.stderr)
        return 2
    try:
        report = evaluate(target, head, prompts, settings, sampler=RejectionSampler(args.backend))
    except (SpecError, ValueError) as e:
        print(f"draftkit eval: error: {e}", file=sys.stderr)
        return 2
    report.update(head_dir=str(head_dir) if head_dir else None, prompt_files=args.prompts, draft_source=source,
                  dtype_choice=target.dtype_choice, dtype_stages=stages.to_dict(),
                  **({ENGINE_DRAFT_KEY: {"sglang": sglang}, "engine_draft_source": {"sglang": sglang_source}}
                     if sglang else {}))
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
    fails = report.get("greedy_failures") or []
    if report.get("lossless", True) and fails:  # lossless acceptance must give the target's own T = 0 tokens
        print(f"draftkit eval: error: {len(fails)} T = 0 difference(s) from plain decoding outside the near-tie "
              f"gap ({report.get('greedy_tie_gap')} nats of the float32 top): a bug under lossless acceptance; "
              f"the first: {fails[0]} (all in report.md)", file=sys.stderr)
        return 1
    return 0
