"""`train.engine_eval_every`: the head as it stands at step N, served by vLLM on the held-aside prompts.

    engine = preflight(recipe, target, head, run_dir)        # before training: vLLM found, head servable
    stats.update(engine.measure(head, prompt_ids, step))      # every N steps, rank 0

Every N steps rank 0 saves the current head into a temporary directory under the run
(<output_dir>/.engine-eval-step<N>-*, removed afterwards; the save is atomic), exports it to vLLM's
layout as `draftkit eval --engine vllm` does (engines/vllm_eval.py: prepare_export; an EAGLE-1 draft
vocabulary is served over the full vocabulary), starts vLLM on the target's safetensors directory
(the export's verifier) with the chain that serves the head (k = train.eval_k; Medusa: its number of
heads), decodes the same held-aside prompts as train.eval_every's loop (T = 0, batch 1, max new
tokens train.eval_max_new_tokens, stopping at the target's stop ids) in the dtype the target trains
in (fp32 unless target.dtype resolves to another), and returns vLLM's own counters as log fields:

  engine_tau          1 + accepted / drafts (vLLM's counters; the same meaning as the loop's tau)
  engine_alpha_<i>    conditional acceptance at position i (as alpha_<i>), i = 1..k
  engine_accepted_<i> drafts whose first i tokens were all accepted (vLLM's accepted_per_pos[i-1])
  engine_drafts       (request, step) pairs that drafted
  engine_tokens_per_s vLLM's decoding rate on this machine (engine start not included)
  engine_head_digest  sha256[:16] of the tensors of the export vLLM was handed (weights_digest): which
                      head was served, comparable with the digest of the step's checkpoint, exported

The other ranks do not serve: they wait at the barrier after the measurement (loop.py), as for
train.eval_every. An engine that fails midway (EngineError) is logged as a warning and the record
gets `engine_error`; training goes on. Everything that can be known before training (a Python with
vLLM, a family vLLM serves, an export vLLM can load for this target, head sizes vLLM's CPU attention
runs, a local verifier directory) is checked by `preflight`, which raises ConfigError naming
train.engine_eval_every.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from draftkit.engines.vllm import (EngineError, EngineRequest, EngineRun, EngineUnavailable, Sampling, engine_figures,
                                   find_python, serve, speculative_config)

log = logging.getLogger(__name__)
FIELD = "train.engine_eval_every"


@dataclass
class EngineTrainEval:
    """What every measurement of one run shares (preflight builds it)."""

    python: str  # the Python with vLLM
    family: str
    k: int  # num_speculative_tokens
    dtype: str  # vLLM's dtype: the target's
    model_dir: str  # the target's safetensors directory vLLM loads (the export's verifier)
    max_new_tokens: int
    stop_ids: list[int]
    target: object
    run_dir: Path

    def measure(self, head, prompts, step: int) -> dict:
        """Export `head` as it is now, serve it on `prompts` (the held-aside ones: distill Prompts,
        encoded as the loop's eval encodes them), return the log fields (module doc)."""
        ids = prompt_ids(self.target, prompts, self.k, self.max_new_tokens)
        if not ids:
            return {}
        work = Path(tempfile.mkdtemp(prefix=f".engine-eval-step{step}-", dir=self.run_dir))
        try:
            export, _ = self.export(head, work)
            run = EngineRun("T=0", Sampling(temperature=0.0, max_tokens=self.max_new_tokens,
                                            stop_token_ids=self.stop_ids), batch_size=1)
            req = EngineRequest(self.model_dir, ids, [run], speculative_config(self.family, self.k, export),
                                dtype=self.dtype)
            served = {"engine_head_digest": weights_digest(export)}
            try:
                result = serve(req, python=self.python)["runs"][0]
            except EngineError as e:
                log.warning("%s: step %d: vLLM failed; training goes on: %s", FIELD, step, e)
                return {"engine_error": str(e).splitlines()[0], **served}
            return {**log_fields(engine_figures(result["counters"], self.k), result["tokens_per_s"]), **served}
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def export(self, head, work: Path) -> tuple[Path, dict]:
        """(the vLLM export of `head` in `work`, its contract): vllm_eval.prepare_export, the eval path's."""
        return export_now(head, self.target, work)


def export_now(head, target, work: Path) -> tuple[Path, dict]:
    from draftkit.engines.vllm_eval import prepare_export

    head.save_pretrained(work / "head")
    export, contract, _ = prepare_export(work / "head", target, work)
    return export, contract


def weights_digest(export: Path) -> str:
    """sha256[:16] over every tensor of an export's safetensors files, in name order (name, dtype,
    shape, bytes): equal for equal weights whatever the file's layout, different for any change."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    tensors = {n: t for f in sorted(Path(export).glob("*.safetensors")) for n, t in load_file(f).items()}
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        h.update(f"{name} {t.dtype} {tuple(tensors[name].shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def log_fields(f: dict, tokens_per_s: float) -> dict:
    """engine_figures(...) -> flat, numeric log fields (the module doc names them)."""
    out = {"engine_tau": f["tau"] if f["tau"] is not None else 1.0, "engine_drafts": float(f["drafts"]),
           "engine_tokens_per_s": float(tokens_per_s)}
    for i, (a, n) in enumerate(zip(f["alpha"], f["accepted_per_pos"])):
        out[f"engine_alpha_{i + 1}"] = a if a is not None else 0.0
        out[f"engine_accepted_{i + 1}"] = float(n)
    return out


def prompt_ids(target, prompts, k: int, max_new_tokens: int) -> list[list[int]]:
    """The held-aside prompts as token ids, as train.eval_every's loop encodes and skips them
    (inference/evaluate.py: chat template; too long for the context with k + 1: skipped)."""
    from draftkit.inference.evaluate import _prepare, as_prompts

    items, _ = _prepare(target, as_prompts(prompts), k, max_new_tokens)
    return [it["ids"] for it in items]


def preflight(recipe, target, head, run_dir: Path) -> EngineTrainEval:
    """Everything train.engine_eval_every needs, checked before training (ConfigError naming the
    setting): held-aside prompts, the current head exported to vLLM's layout (every export refusal:
    MTP, Gemma targets, ...), a target and head vLLM's CPU build can serve (vllm_eval.cpu_serving_refusal:
    attention head sizes; not judged where a CUDA device is visible), vLLM found (engines/vllm.py:
    find_python), the family served (speculative_config) and the export's verifier a local directory
    vLLM can load."""
    from draftkit.engines.vllm_eval import CUDA_SERVES, cpu_serving_refusal
    from draftkit.export import ExportError
    from draftkit.inference.decoder import stop_token_ids
    from draftkit.schema import ConfigError

    t, n = recipe.train, recipe.train.engine_eval_every
    if n < 0:
        raise ConfigError(f"{FIELD}: expected steps >= 0 (0 = off), got {n}")
    if recipe.data.holdout < 1:
        raise ConfigError(f"{FIELD}={n} serves the head on the held-aside prompts, but data.holdout is "
                          f"{recipe.data.holdout}: set data.holdout >= 1")
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        work = Path(tempfile.mkdtemp(prefix=".engine-eval-check-", dir=run_dir))
        try:
            export, contract = export_now(head, target, work)  # ExportError: what vLLM's layout refuses
            refusal = cpu_serving_refusal(target, export)  # head sizes vLLM's CPU attention cannot run
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if refusal:
            raise ValueError(f"{refusal}; {CUDA_SERVES}; set {FIELD}=0 to train without serving the head")
        python = find_python()
        k = contract["head"]["num_heads"] if head.family == "medusa" else t.eval_k  # as vllm_eval
        speculative_config(head.family, k, run_dir)  # ValueError: a family vLLM does not serve
        probe = EngineTrainEval(python, head.family, k, str(target.dtype).replace("torch.", ""),
                                verifier_dir(contract), t.eval_max_new_tokens, stop_token_ids(target), target, run_dir)
    except (EngineUnavailable, ExportError, ValueError) as e:
        raise ConfigError(f"{FIELD}={n}: {e}") from None
    log.info("%s=%d: vLLM (%s) will serve the %s head as a chain of %d on the held-aside prompts, %s, T = 0",
             FIELD, n, python, head.family, k, probe.dtype)
    return probe


def verifier_dir(contract: dict) -> str:
    """The target directory an export's contract names as its verifier; vLLM loads it (no downloads)."""
    name = (contract.get("verifier") or {}).get("name_or_path")
    if not name or not Path(name).is_dir():
        raise ValueError(f"the head's export names no local verifier directory ({name!r}); vLLM serves the target "
                         "from its safetensors directory: set target.path to a model directory (the embedded and "
                         "GGUF targets are converted to one)")
    return name


def preflight_ranks(recipe, target, head, run_dir: Path, main: bool, device) -> EngineTrainEval | None:
    """preflight on rank 0 only (the only rank that serves); every rank raises when it fails, so
    none goes on into training alone. None on the other ranks and when the setting is 0."""
    from draftkit.schema import ConfigError
    from draftkit.train.distributed import any_true

    if not recipe.train.engine_eval_every:
        return None
    found, error = None, None
    if main:
        try:
            found = preflight(recipe, target, head, run_dir)
        except ConfigError as e:
            error = e
    if any_true(error is not None, device):
        raise error or ConfigError(f"{FIELD}: rank 0's check of vLLM failed (rank 0's message says why)")
    return found
