"""Pallas kernels (``dflash_jax.kernels``); they import nothing from the rest of the library.

``block_attention``: the DFlash draft's training attention (see block_attention.py); ``decode_attention``:
decode / verify attention bounded by each row's length (see decode_attention.py), ``paged_decode_attention``
the same over a paged cache (see paged_attention.py); ``reference``: the
dense attention and position mask they are checked against, which the library uses as its attention;
``tiling``: what both kernels share (online softmax, tile config, platform probe, cost estimate);
``bench``: the skip statistics (``skipped_fraction``) and the benchmark CLI.
"""
from .block_attention import (
    block_attention,
    block_attention_reference,
    block_mask,
    kernel_supported,
)
from .decode_attention import (
    decode_attention,
    decode_attention_loop,
    decode_attention_reference,
    decode_kernel_supported,
)
from .paged_attention import paged_decode_attention, paged_decode_attention_reference, paged_kernel_supported

__all__ = ["block_attention", "block_attention_reference", "block_mask", "decode_attention", "decode_attention_loop",
           "decode_attention_reference", "decode_kernel_supported", "kernel_supported", "paged_decode_attention",
           "paged_decode_attention_reference", "paged_kernel_supported"]
