"""Entry point: `deepspeed draftkit/train/run.py RECIPE.yaml [key.path=value ...]`.

Also runs under `torchrun` and plain `python` (one process), and as `draftkit train`.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file by a launcher: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (recipes/eagle.yaml, ...)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.max_steps=20")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from draftkit.config import recipe_for_launch
    from draftkit.schema import ConfigError

    recipe = recipe_for_launch(args.recipe, args.overrides, args.local_rank)  # the launcher passes --local_rank
    if recipe is None:
        return 2
    from draftkit.heads import HeadError
    from draftkit.target import TargetError
    from draftkit.train.checkpoint import ResumeError
    from draftkit.train.loop import NonFiniteLoss, train

    try:
        head_dir = train(recipe)
    except (ConfigError, TargetError, HeadError, ResumeError, NonFiniteLoss, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"head exported to {head_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftkit/train/run.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
