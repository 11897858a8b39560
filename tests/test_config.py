"""draftkit.config: the recipe schema stands on its own, and the recipe says how much data a run needs."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from draftkit.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_the_recipe_schema_imports_without_torch_or_distill():
    """Reading a recipe (draftkit plan, a launcher's argument check) must not pull in torch or the
    distillation code: every setting of the recipe is defined in draftkit/config.py itself."""
    code = ("import sys, draftkit.config as c; c.load_recipe(None, ['data.grounded.fraction=0.5']); "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'draftkit.distill'))); "
            "assert not bad, bad[:5]")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("overrides, global_batch, want", [
    (["train.max_steps=10"], 8, 80),  # one pass: every step a fresh global batch
    (["train.max_steps=10", "train.epochs=3"], 8, 27),  # three passes over ceil(80 / 3) samples
    (["train.max_steps=10", "data.num_prompts=5"], 8, 5),  # asked for: the epochs follow from it
    (["train.max_steps=1", "train.epochs=9"], 2, 1),  # never fewer than one
])
def test_samples_needed_is_the_runs_consumption(overrides, global_batch, want):
    assert load_recipe(None, overrides).samples_needed(global_batch) == want


def _imports(path: Path) -> set[str]:
    """The draftkit modules a file imports, at the top or inside a function (a lazy import still ties
    two files), leaving out `if TYPE_CHECKING:` blocks (annotations only)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("draftkit")}


def _circle(modules: dict[str, set[str]]) -> list[str] | None:
    """One import circle among `modules` (name -> the names it imports), or None."""
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(modules[m] & set(modules)):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(modules) if m not in state and (c := visit(m, [m]))), None)


@pytest.mark.parametrize("folders", [("draftkit/export",), ("draftkit/distill", "draftkit/train")])
def test_no_import_circles(folders):
    """The export package is one-way (layouts register from its __init__; the llama / EAGLE-3 parts
    every engine shares are one module), and so are distill and train (stage 1 never imports the loop)."""
    files = [f for d in folders for f in sorted((ROOT / d).glob("*.py")) if f.name != "__init__.py"]
    modules = {".".join(f.relative_to(ROOT).with_suffix("").parts): _imports(f) for f in files}
    assert len(modules) > 5
    assert _circle(modules) is None, _circle(modules)
