"""`draftkit import DIR --format FORMAT --out HEAD_DIR`: convert a served or published head into draftkit."""
from __future__ import annotations

import argparse
import sys

from draftkit.export.cli import add_target_argument, load_target_arg
from draftkit.export.layout import FORMATS, IMPORT_ONLY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="DIR", help="a head directory in FORMAT")
    parser.add_argument("--format", required=True, choices=FORMATS + IMPORT_ONLY,
                        help="the layout DIR is in (eagle-official / eagle3-official / medusa-official: "
                             "the published release layouts)")
    parser.add_argument("--out", required=True, metavar="HEAD_DIR", help="native head directory to create")
    parser.add_argument("--overwrite", action="store_true", help="replace HEAD_DIR if it exists")
    parser.add_argument("--family", default=None, help="head family, when DIR's config does not say")
    add_target_argument(parser, "the target the head drafts for; required for published heads "
                                "(it fills the dims and checks stored shared tensors)")


def run(args: argparse.Namespace) -> int:
    from draftkit.export.formats import ExportError, import_head
    from draftkit.heads.base import HeadError
    from draftkit.target import TargetError

    try:
        out = import_head(args.src, args.format, args.out, target=load_target_arg(args.target),
                          overwrite=args.overwrite, family=args.family)
    except (ExportError, HeadError, TargetError) as e:
        print(f"draftkit import: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote native head to {out}")
    return 0
