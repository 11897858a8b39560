"""`draftkit inspect DIR [--target [MODEL]]`: say what a head directory is, and check it against a target."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftkit.export.cli import add_target_argument, load_target_arg
from draftkit.export.layout import FORMATS, IMPORT_ONLY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="an export, a native head, or a published EAGLE/Medusa head")
    parser.add_argument("--format", default=None, choices=FORMATS + IMPORT_ONLY,
                        help="the layout DIR is in (default: detect from config.json)")
    parser.add_argument("--family", default=None, help="head family, when DIR's config does not say")
    add_target_argument(parser, "verify sizes, feature layers and the embedding/lm_head fingerprint against it")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def inspect_dir(directory: str | Path, *, fmt: str | None = None, target=None, family: str | None = None) -> dict:
    """{'format', 'family', 'lines': [...], 'problems': [...]}; problems empty = loads and fits."""
    from draftkit.export.contract import check_target, describe, make_contract
    from draftkit.export.files import dtype_name, find_contract, read_dir
    from draftkit.export.formats import ExportError, detect_format, layout_for

    directory = Path(directory)
    report: dict = {"directory": str(directory), "lines": [], "problems": []}
    try:
        cfg, tensors = read_dir(directory)
    except ExportError as e:
        report["problems"].append(str(e))
        return report
    fmt = fmt or detect_format(directory, cfg)
    contract = find_contract(directory, cfg)
    n_params = sum(t.numel() for t in tensors.values())
    report.update(format=fmt, tensors=len(tensors), parameters=n_params, dtype=dtype_name(tensors))
    lines = report["lines"]
    lines.append(f"{directory}: {fmt} layout, {len(tensors)} tensors, {n_params:,} parameters, {report['dtype']}")
    try:
        native, state = native_of(directory, fmt, family, target, contract, lines)
    except (ExportError, ValueError) as e:
        report["problems"].append(str(e))
        native = None
    if native is not None:
        report["family"] = native["family"]
        if fmt not in ("draftkit",):
            lines.append(f"family {native['family']}; layout follows {layout_for(fmt, native['family']).source}")
        if contract is None:
            contract = make_contract(native, state, fmt, None if fmt == "draftkit" else layout_for(fmt, native["family"]))
            lines.append("no draftkit contract in this directory; derived from its config:")
        lines.extend(describe(contract, str(directory)))
    if target is not None:
        lines.append(f"target {target.name}: hidden {target.hidden_size}, vocab {target.vocab_size}, "
                     f"{target.num_layers} layers, fingerprint {target.fingerprint}")
        subject = native if native is not None else (contract or {})
        problems = check_target(subject, target)
        if not (subject.get("target") or {}).get("fingerprint"):
            lines.append("no target fingerprint recorded: checked sizes and layers only")
        report["problems"].extend(problems)
    report["contract"] = contract
    return report


def native_of(directory: Path, fmt: str, family: str | None, target, contract: dict | None, lines: list[str]):
    """(native config, tensors) of DIR, converted without a target where the layout needs none. Where
    it needs one (a speculators DFlash export embeds its mask slots with the target's embedding row;
    a stored embedding or lm_head is checked against the target's): the given target when it fits the
    export (a misfit is reported by the target check), else the target the export records (its
    verifier, a local directory whose fingerprint the export checked), loaded as `export` loads it."""
    from draftkit.export.contract import check_target
    from draftkit.export.formats import to_native
    from draftkit.export.layout import ExportError, TargetNeeded, recorded_target

    try:
        return to_native(directory, fmt, target=None, family=family)
    except TargetNeeded as e:
        why = e.why
    if target is not None and check_target(contract or {}, target):
        raise ExportError(f"{why}: not converted with target {target.name}, which does not fit this export")
    if target is None:
        if not (contract or {}).get("verifier"):
            raise ExportError(f"{why}: this directory records no verifier; pass --target MODEL")
        target = recorded_target(contract["verifier"], why)
        lines.append(f"converted with the export's recorded target {target.name} (fingerprint checked): {why}")
    return to_native(directory, fmt, target=target, family=family)


def run(args: argparse.Namespace) -> int:
    from draftkit.target import TargetError

    try:
        target = load_target_arg(args.target)
    except TargetError as e:
        print(f"draftkit inspect: error: {e}", file=sys.stderr)
        return 1
    report = inspect_dir(args.directory, fmt=args.format, target=target, family=args.family)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(report["lines"]))
        for p in report["problems"]:
            print(f"PROBLEM: {p}")
        print("OK" if not report["problems"] else f"{len(report['problems'])} problem(s)")
    return 0 if not report["problems"] else 1
