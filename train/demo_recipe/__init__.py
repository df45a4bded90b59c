"""The demo recipe (``python -m train.demo_recipe``): pretrain the demo target on the stdlib, then train its draft."""
