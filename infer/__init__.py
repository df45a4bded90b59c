"""Command-line inference: ``python -m infer.generate`` and ``python -m infer.benchmark``."""
