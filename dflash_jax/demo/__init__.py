"""The embedded demo pair (``target/``, ``draft/``: package data) and its corpus (``corpus.py``).

``python -m train.demo_recipe`` reproduces the pair into these directories; ``infer`` uses them by default.
"""
import os

DEMO_DIR = os.path.dirname(os.path.abspath(__file__))
DEMO_TARGET = os.path.join(DEMO_DIR, "target")
DEMO_DRAFT = os.path.join(DEMO_DIR, "draft")
