"""Pallas kernels. ``block_attention``: the DFlash draft's training attention (see block_attention.py)."""
from kernels.block_attention import (
    block_attention,
    block_attention_reference,
    block_mask,
    kernel_supported,
    skipped_fraction,
)

__all__ = ["block_attention", "block_attention_reference", "block_mask", "kernel_supported", "skipped_fraction"]
