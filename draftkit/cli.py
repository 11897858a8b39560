"""`draftkit` subcommands: thin shells over the modules that do the work.

Each command lives in a module exposing `add_arguments(parser)` and `run(args) -> int` (and, if it
wants, HELP_FORMATTER); modules are imported only when their command runs, so `draftkit eval` never
imports DeepSpeed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

DESCRIPTION = ("draftkit: train speculative-decoding draft heads (EAGLE, EAGLE-3, Medusa, MTP) against a frozen "
               "target model, measure their real acceptance and speedup, and export them for serving engines.")
EPILOG = "Typical run: draftkit plan RECIPE; draftkit train RECIPE; draftkit eval --head RUN/head; draftkit export ..."


def version() -> str:
    """The installed package's version (importlib.metadata); the source tree's when not installed."""
    try:
        return importlib.metadata.version("draftkit")
    except importlib.metadata.PackageNotFoundError:
        import draftkit

        return f"{draftkit.__version__} (not installed)"


COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("draftkit.plan", "what a recipe's run will cost (params, memory per rank, data, steps) and what is wrong"),
    "train": ("draftkit.train.run", "train a head from a recipe (same as draftkit/train/run.py)"),
    "prepare": ("draftkit.distill.prepare", "prepare a recipe's data as shards (same as draftkit/distill/prepare.py)"),
    "eval": ("draftkit.inference.cli_eval", "measure real acceptance and speedup of a head"),
    "export": ("draftkit.export.cli", "write a head in a serving format (vllm, sglang, speculators)"),
    "import": ("draftkit.export.cli_import", "convert a serving-format or published head into draftkit"),
    "inspect": ("draftkit.export.cli_inspect", "say what a head directory is and check it against a target"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="draftkit", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"draftkit {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:  # --version prints and exits inside parse_args
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd = argparse.ArgumentParser(prog=f"draftkit {argv[0]}", description=COMMANDS[argv[0]][1],
                                  formatter_class=getattr(module, "HELP_FORMATTER", argparse.HelpFormatter))
    module.add_arguments(cmd)
    return int(module.run(cmd.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
