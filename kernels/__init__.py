"""Pallas kernels, installed as ``dflash_jax.kernels``; they import nothing from the library.

``block_attention``: the DFlash draft's training attention (see block_attention.py); ``reference``: the
dense attention and position mask it is checked against, which the library uses as its attention.
"""
from .block_attention import (
    block_attention,
    block_attention_reference,
    block_mask,
    kernel_supported,
    skipped_fraction,
)

__all__ = ["block_attention", "block_attention_reference", "block_mask", "kernel_supported", "skipped_fraction"]
