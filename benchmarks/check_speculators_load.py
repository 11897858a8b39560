"""Check that draftkit's speculators-format EAGLE-3 export loads in the `speculators` package from PyPI.

    python benchmarks/check_speculators_load.py [--venv DIR] [--keep DIR] [--json OUT.json] [--targets tiny embedded]

speculators pins torch / transformers versions of its own, so it runs in its own virtual environment
(default: $DRAFTKIT_CACHE/speculators-venv, created on first use: ~6 min and ~6 GB when pip pulls a
CUDA torch; pass --venv to reuse one). Steps:
  1. here (draftkit's env), for each of --targets: `tiny`, a tiny random llama saved as the verifier,
     and `embedded`, the embedded SmolLM2-135M default (its converted safetensors directory is the
     verifier the export names by default, export/verifier.py): an EAGLE-3 head trained a few steps
     on it, `draftkit export --format speculators` with the default verifier;
  2. there (speculators' env): SpeculatorModelConfig.from_pretrained must give an
     Eagle3SpeculatorConfig with our draft vocab and aux layer ids, SpeculatorModel.from_pretrained
     an Eagle3DraftModel holding every tensor of the file bit-for-bit, missing only what speculators
     takes from the verifier (embed_tokens, verifier_norm, verifier_lm_head).
Exit 0 = loads; 1 = does not; 77 = skipped because pip could not reach the package index (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 77

CHECK = r"""
import json, sys, torch
from importlib.metadata import version
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig

path = sys.argv[1]
want = json.load(open(path + "/config.json"))
cfg = SpeculatorModelConfig.from_pretrained(path)
model = SpeculatorModel.from_pretrained(path)
state, file = model.state_dict(), load_file(path + "/model.safetensors")
missing = sorted(set(state) - set(file))
print(json.dumps({
    "speculators_version": version("speculators"), "transformers_version": version("transformers"),
    "torch_version": version("torch"),
    "config_class": type(cfg).__name__, "model_class": type(model).__name__,
    "draft_vocab_size": cfg.draft_vocab_size, "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
    "want_aux_layer_ids": want["eagle_aux_hidden_state_layer_ids"],
    "unloaded_file_tensors": sorted(set(file) - set(state)),
    "not_in_file": missing,
    "mismatched": sorted(k for k in file if k in state and not torch.equal(state[k].to(file[k].dtype), file[k])),
}))
"""
FROM_VERIFIER = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}


def default_venv() -> Path:
    return Path(os.environ.get("DRAFTKIT_CACHE", Path.home() / ".cache" / "draftkit")) / "speculators-venv"


def ensure_venv(venv: Path) -> tuple[Path, float]:
    """The venv's python, creating it when needed; (python, seconds spent installing)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import speculators"], capture_output=True).returncode == 0:
        return python, 0.0
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    # torch first (and pinned in the same resolve), so pip does not pull a CUDA build on its own.
    for args in (["torch==2.13.0"], ["speculators"]):
        r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", *args], capture_output=True, text=True)
        if r.returncode != 0:
            unreachable = any(s in r.stderr for s in ("Failed to establish a new connection", "No matching distribution",
                                                      "Could not find a version"))
            print(r.stderr[-2000:], file=sys.stderr)
            if unreachable:
                print(f"SKIPPED: pip could not install {' '.join(args)} (package index unreachable?)")
                sys.exit(SKIP)
            raise SystemExit(f"pip install {' '.join(args)} failed")
    return python, time.time() - t0


def make_export(work: Path, which: str = "tiny") -> tuple[Path, int]:
    """(export directory, draft vocabulary size) of an EAGLE-3 head on the `which` target."""
    sys.path.insert(0, str(ROOT))
    import torch

    from draftkit.export import export_head
    from draftkit.heads import build_head
    from draftkit.target import Target, load_target
    from tests.conftest import fit, make_tiny_target

    work = work / which
    if which == "tiny":
        tiny = make_tiny_target()
        tiny.model.save_pretrained(work / "verifier")  # speculators resolves the verifier by path
        target, settings = Target(tiny.model, None, name=str(work / "verifier")), {"feature_layers": [1, 2, 3]}
    else:
        target, settings = load_target(None, dtype="float32"), {}
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, **settings}, target)
    ids = torch.randint(3, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    head.set_draft_vocab(tokens=ids)
    fit(head, target.features(ids, None, head.feature_layers), steps=3, lr=1e-3)  # a trained head, not an init
    head.save_pretrained(work / "head")
    return export_head(work / "head", "speculators", work / "export"), 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=default_venv(), help="speculators' virtual environment")
    ap.add_argument("--keep", type=Path, default=None, help="write the export here instead of a temp dir")
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    ap.add_argument("--targets", nargs="+", choices=("tiny", "embedded"), default=["tiny", "embedded"],
                    help="heads to check: on a tiny random llama, on the embedded SmolLM2-135M")
    args = ap.parse_args()
    python, install_s = ensure_venv(args.venv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="draftkit-speculators-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for which in args.targets:
        results[which] = check(python, *make_export(work, which))
        results[which]["install_seconds"] = round(install_s, 1)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    failed = [f"{w}: " + "; ".join(r["problems"]) for w, r in results.items() if r["problems"]]
    print("OK: the speculators exports load in speculators" if not failed else "FAIL: " + " | ".join(failed))
    return 0 if not failed else 1


def check(python: Path, export: Path, draft_vocab: int) -> dict:
    """Load `export` in speculators' venv; the result, with `problems` (empty = loads faithfully)."""
    t0 = time.time()
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the verifier resolves by path
    r = subprocess.run([python, "-c", CHECK, str(export)], capture_output=True, text=True, env=offline)
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        return {"export": str(export), "problems": ["speculators could not load the export"]}
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result.update(load_seconds=round(time.time() - t0, 1), export=str(export),
                  verifier=json.loads((export / "config.json").read_text())["speculators_config"]["verifier"])
    problems = []
    if not Path(result["verifier"]["name_or_path"] or "").is_dir():
        problems.append(f"the verifier {result['verifier']['name_or_path']!r} is not a local model directory")
    if result["config_class"] != "Eagle3SpeculatorConfig" or result["model_class"] != "Eagle3DraftModel":
        problems.append("wrong config/model class")
    if result["aux_layer_ids"] != result["want_aux_layer_ids"] or result["draft_vocab_size"] != draft_vocab:
        problems.append("aux layer ids or draft vocab changed on load")
    if result["unloaded_file_tensors"] or result["mismatched"]:
        problems.append("file tensors not loaded bit-for-bit")
    if set(result["not_in_file"]) - FROM_VERIFIER:
        problems.append(f"model parameters the file does not provide: {set(result['not_in_file']) - FROM_VERIFIER}")
    result["problems"] = problems
    return result


if __name__ == "__main__":
    sys.exit(main())
