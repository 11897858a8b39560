"""`draftkit export HEAD_DIR --format FORMAT --out DIR`: write a head in a serving engine's layout."""
from __future__ import annotations

import argparse
import sys

from draftkit.export.layout import FORMATS


def add_target_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--target", nargs="?", const="", default=None, metavar="MODEL",
                        help=f"{help_text} (a model dir, .gguf or hub id; no value = the embedded default)")


def load_target_arg(value: str | None):
    if value is None:
        return None
    from draftkit.target import load_target

    return load_target(value or None, dtype="float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("head_dir", metavar="HEAD_DIR", help="a native head directory (what training writes)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the serving layout to write")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the weights (default: keep the head's dtype)")
    parser.add_argument("--full-vocab", action="store_true", default=None,
                        help="a head with a draft vocabulary (d2t) for an engine without one (vLLM/SGLang "
                             "EAGLE-1): export it drafting over the full target vocabulary instead of refusing; "
                             "unset: done for vLLM (its llama_eagle.py has no d2t; a note says so), refused for SGLang")
    add_target_argument(parser, "check the head against this target first; unset: when the engine must store a "
                                "tensor the head shares with the target (Medusa's lm_head), the head's recorded "
                                "target is loaded from its verifier directory (fingerprint checked)")
    parser.add_argument("--verifier", default=None, metavar="ID_OR_PATH",
                        help="the model the export names as the head's verifier (a model directory or hub id); "
                             "default: the target it was trained on (its directory or hub id; a GGUF or the "
                             "embedded target: the safetensors directory it converts into). Checked against the "
                             "head's target fingerprint: refused when it differs")


def run(args: argparse.Namespace) -> int:
    from draftkit.export.formats import ExportError, export_head
    from draftkit.heads.base import HeadError
    from draftkit.target import TargetError

    try:
        out = export_head(args.head_dir, args.format, args.out, target=load_target_arg(args.target),
                          overwrite=args.overwrite, dtype=args.dtype, full_vocab=args.full_vocab,
                          verifier=args.verifier)
    except (ExportError, HeadError, TargetError) as e:
        print(f"draftkit export: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.format} export to {out} (check it: draftkit inspect {out})")
    return 0
