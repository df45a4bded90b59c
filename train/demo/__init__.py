"""The demo recipe (``python -m train.demo``): pretrain the demo target on the stdlib, then train its draft."""
