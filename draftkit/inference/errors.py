"""The loop's one error type, below every module of the loop so each can raise it."""


class SpecError(ValueError):
    """Bad settings for the loop (k out of range, prompt too long, empty prompt list)."""
