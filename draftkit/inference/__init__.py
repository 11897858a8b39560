"""Inference: the draft-verify loop, the rejection sampler (torch reference + Triton kernels), evaluation.

Importable with the core dependencies only (torch, triton, transformers, safetensors).
"""
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.errors import SpecError
from draftkit.inference.stats import SpecStats
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.rejection import RejectionSampler
from draftkit.inference.sampling import SamplingParams, logits_to_probs, make_generators
from draftkit.inference.evaluate import evaluate  # noqa: E402  (the function; the module stays in sys.modules)


__all__ = ["SpecDecoder", "SpecError", "SpecStats", "plain_generate", "NgramDrafter", "RejectionSampler",
           "SamplingParams", "logits_to_probs", "make_generators", "evaluate"]
