"""Training: the launcher entry point (run.py) and the loop around DeepSpeed (loop.py)."""
