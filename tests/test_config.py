"""draftkit.config: the recipe schema stands on its own, and the recipe says how much data a run needs."""
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
