"""draftkit: train speculative-decoding draft heads against a frozen target and measure real acceptance."""
__version__ = "0.1.0"
