"""Serving engines in the loop: a head served by a real engine, its acceptance read from the engine.

One module per engine (vllm.py). An engine runs in its own Python (its own virtual environment,
cached under $DRAFTKIT_CACHE, see scripts/setup_vllm.sh) through a small worker script that imports
nothing of draftkit: JSON request in, JSON result out.
"""
from draftkit.engines.vllm import EngineError, EngineUnavailable

__all__ = ["EngineError", "EngineUnavailable"]
