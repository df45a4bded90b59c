"""Decoding: the closed-batch drivers (``speculative_generate``, ``generate``, ``stream_generate``,
``lower_step``), continuous batching (``Engine``: admit / step / run / release over S rows of paged caches; ``continuous_generate``),
the options (``DecodeOptions``, per-request ``Request``) and what a row returns (``GenerationResult``, ``Finish``).

Modules: ``types`` (spec, state, results), ``options``, ``prepare`` (host side), ``verify`` (chain, adaptive, tree,
commit), ``steps`` (the jitted programs), ``proposers`` (what a step drafts, by draft architecture), ``programs``
(the bounded compile table), ``pages`` (the page allocator), ``batch`` and ``slots`` (the drivers)."""
from dflash_jax.decode.batch import generate, lower_step, speculative_generate, stream_generate
from dflash_jax.decode.options import (PARAMS, DecodeOptions, Request, check_budget_and_seed,
                                       resolve_block_size)
from dflash_jax.decode.prepare import cache_length
from dflash_jax.decode.slots import Engine, Resumed, RunStats, continuous_generate, stream_requests
from dflash_jax.decode.types import DecodeState, Finish, GenerationResult
from dflash_jax.decode.verify import verify_choice

__all__ = ["DecodeOptions", "DecodeState", "Engine", "Finish", "GenerationResult", "PARAMS", "Request", "Resumed", "RunStats",
           "cache_length", "check_budget_and_seed", "continuous_generate", "generate", "lower_step",
           "resolve_block_size", "speculative_generate", "stream_generate", "stream_requests", "verify_choice"]
