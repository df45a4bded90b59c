"""``SpeculativeRollout``: Tunix's rollout engine interface (``tunix.rl.rollout.base_rollout.BaseRollout``) on the
project's speculative engine (``decode.Engine``: one engine, its programs compiled once, reused by every call).

With google-tunix installed (the ``rl`` extra) the class subclasses Tunix's ``BaseRollout`` and returns Tunix's
``RolloutOutput``; without it, this module defines ``BaseRollout``, ``RolloutConfig`` and ``RolloutOutput`` of the same
names and fields (those this engine reads), so the adapter runs in a loop of one's own. Conventions follow Tunix's
own engines: prompts left-padded with ``pad_id`` to ``RolloutConfig.max_prompt_length`` (or the next power of two
of the longest prompt, when longer), completions right-padded with ``pad_id`` to ``max_tokens_to_generate``, each
completion ending with its EOS token when it stopped (as vLLM's; ``common.make_completion_mask`` keeps it), and
``logprobs`` one float32 array per sample, the target's log_softmax(logits / T) of each sampled token at the
temperature T used (greedy: at 1), padded with 0 to ``max_tokens_to_generate`` (Tunix's GRPO learner pads them the
same). ``logits`` is None: the engine keeps no [B, T, V] logits (Tunix's ``RLCluster.generate`` accepts that)."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import DecodeOptions, Engine, Request, stream_requests
from dflash_jax.rl.tunix_params import from_tunix_qwen3
from dflash_jax.scoring import per_token_logps
from dflash_jax.target import Target

try:  # the rl extra; everything below works without it
    from tunix.rl.rollout.base_rollout import BaseRollout, RolloutConfig, RolloutOutput
    TUNIX = True
except ImportError:  # the same names and fields, without Tunix
    TUNIX = False

    @dataclasses.dataclass
    class RolloutConfig:
        """Tunix's ``RolloutConfig`` (the fields this engine reads; Tunix's defaults)."""

        max_tokens_to_generate: int = 64
        temperature: float = 0.9  # 0: greedy
        top_p: float | None = 1.0
        top_k: int | None = None  # None or -1: off
        seed: Any = None  # an int or a jax PRNG key (None: 0)
        max_prompt_length: int = 64
        eos_tokens: list[int] | None = None  # None: the tokenizer's EOS

    @dataclasses.dataclass
    class RolloutOutput:
        """Tunix's ``RolloutOutput``."""

        text: list[str]
        logits: Any
        tokens: jax.Array
        left_padded_prompt_tokens: jax.Array
        logprobs: list | None

    class BaseRollout(abc.ABC):
        """Tunix's ``BaseRollout`` interface."""

        @abc.abstractmethod
        def generate(self, prompts, rollout_config, **kwargs): ...

        @abc.abstractmethod
        def get_per_token_logps(self, prompt_tokens, completion_tokens, completion_mask=None): ...

        @abc.abstractmethod
        def update_params(self, params, filter_types=None): ...

        @abc.abstractmethod
        def pad_id(self) -> int: ...

        @abc.abstractmethod
        def eos_id(self) -> int: ...

        @abc.abstractmethod
        def model(self): ...


def seed_int(seed) -> int:
    """Tunix's seed (None, an int, or a jax PRNG key, typed or raw uint32) -> the engine's int seed in [0, 2**63)."""
    if seed is None:
        return 0
    if isinstance(seed, (int, np.integer)):
        return int(seed) % 2 ** 63
    if jnp.issubdtype(getattr(seed, "dtype", None), jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    words = np.asarray(seed, np.uint64).ravel()
    value = 0
    for w in words:
        value = (value << 32) | int(w & 0xFFFFFFFF)
    return value % 2 ** 63


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows(tokens: np.ndarray, mask, pad: int, eos: int, left: bool) -> list[list[int]]:
    """Unpadded rows of a padded [B, T] array: left padding (prompts) is every leading ``pad``; a completion runs
    to its first ``pad`` (exclusive) or EOS (inclusive), or as far as ``mask`` (a 0/1 prefix) says."""
    out = []
    for i, row in enumerate(np.asarray(tokens).tolist()):
        if left:
            start = next((j for j, t in enumerate(row) if t != pad), len(row))
            out.append(row[start:])
        elif mask is not None:
            out.append(row[:int(np.asarray(mask[i]).sum())])
        else:
            end = next((j + (t == eos) for j, t in enumerate(row) if t in (eos, pad)), len(row))
            out.append(row[:end])
    return out


class SpeculativeRollout(BaseRollout):
    """Tunix's ``BaseRollout`` on one ``decode.Engine`` of ``target`` and ``draft`` (None: plain decoding).

    ``tokenizer``: Hugging Face-like (``encode``, ``decode``, ``pad_token_id``, ``eos_token_id``), or None (prompts
    given as token lists; ``pad_id`` / ``eos_id`` then needed unless the target's config names an EOS).
    ``max_batch`` rows decode at once, each holding at most ``max_length`` prompt + generated tokens (the caches'
    size). ``options``: ``DecodeOptions`` fields for the engine (``block_size``, ``acceptance``, ``tree_budget``, ...;
    the sampling knobs come from each call's ``RolloutConfig``); ``engine_kw``: ``Engine``'s (``page``,
    ``kv_cache_memory``, ``prefix_cache``, ``block_policy``)."""

    def __init__(self, target: Target, draft=None, tokenizer=None, *, max_batch: int = 8, max_length: int = 1024,
                 pad_id: int | None = None, eos_id: int | None = None, options: dict | None = None,
                 engine_kw: dict | None = None):
        self.tokenizer = tokenizer
        eos = eos_id if eos_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None and target.config.eos_token_id:
            eos = target.config.eos_token_id[0]
        pad = pad_id if pad_id is not None else getattr(tokenizer, "pad_token_id", None)
        if eos is None:
            raise ValueError("SpeculativeRollout needs an EOS id: eos_id=, a tokenizer's eos_token_id, or the "
                             "target config's eos_token_id")
        self._eos, self._pad = int(eos), int(eos if pad is None else pad)
        limit = min(int(max_length), target.config.max_position_embeddings)
        opts = DecodeOptions(max_new_tokens=max(1, limit - 1), max_length=limit, logprobs=0, **(options or {}))
        self.engine = Engine(target, draft, opts, max_batch=max_batch, max_length=limit, sampled=True,
                             **(engine_kw or {}))

    # -- Tunix's interface --------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], rollout_config: RolloutConfig,
                 n: int = 1, **kwargs) -> RolloutOutput:
        """Sample ``n`` completions of every prompt (strings, tokenized without special tokens added, or token
        lists), rows i * n .. i * n + n - 1 for prompt i (``Request.group``: distinct key streams). Stops at the
        config's ``eos_tokens`` (default: ``eos_id()``) or after ``max_tokens_to_generate`` tokens."""
        c = rollout_config
        ids = [self._encode(p) for p in prompts]
        if not ids or any(not len(p) for p in ids):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        budget = int(c.max_tokens_to_generate)
        longest = max(len(p) for p in ids)
        if longest + budget > self.engine.max_length:
            raise ValueError(f"a prompt of {longest} tokens + max_tokens_to_generate {budget} exceeds the engine's "
                             f"max_length {self.engine.max_length}")
        stops = [int(t) for t in (c.eos_tokens or [self._eos])]
        top_k = 0 if c.top_k is None or c.top_k < 0 else int(c.top_k)
        top_p = 1.0 if c.top_p is None else float(c.top_p)
        temperature, seed = float(c.temperature), seed_int(c.seed)
        requests = [r for i, p in enumerate(ids) for r in Request(
            list(p), max_new_tokens=budget, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stream=i,
            stop_token_ids=stops, logprobs=0).group(n)]
        results = dict(stream_requests(self.engine, requests))
        results = [results[j] for j in range(len(requests))]
        width = c.max_prompt_length if longest <= c.max_prompt_length else _next_power_of_2(longest)
        prompt_rows = np.full((len(requests), width), self._pad, np.int32)
        tokens = np.full((len(requests), budget), self._pad, np.int32)
        logprobs, texts = [], []
        for j, (r, q) in enumerate(zip(results, requests)):
            prompt_rows[j, width - len(q.prompt_ids):] = q.prompt_ids
            gen = r.generated_ids
            tokens[j, :len(gen)] = gen
            lp = np.zeros(budget, np.float32)
            lp[:len(gen)] = r.logprobs
            logprobs.append(lp)
            texts.append(self._decode(gen[:-1] if gen and gen[-1] in stops else gen))
        return RolloutOutput(text=texts, logits=None, tokens=jnp.asarray(tokens),
                             left_padded_prompt_tokens=jnp.asarray(prompt_rows), logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens, completion_tokens, completion_mask=None,
                            temperature: float = 1.0) -> jax.Array:
        """[B, T] float32: the target's log_softmax(logits / ``temperature``) of each completion token (Tunix's
        engines score at 1), 0 past each completion. Prompts are left-padded with ``pad_id()``; a completion ends at
        its first pad (exclusive) or EOS (inclusive), or where ``completion_mask`` (0/1, a prefix) ends."""
        prompts = _rows(prompt_tokens, None, self._pad, self._eos, left=True)
        completions = _rows(completion_tokens, completion_mask, self._pad, self._eos, left=False)
        scored = per_token_logps(self.engine.target, prompts, completions, temperature)
        out = np.zeros(np.shape(completion_tokens), np.float32)
        for i, s in enumerate(scored):
            out[i, :len(s)] = s
        return jnp.asarray(out)

    def update_params(self, params, filter_types=None) -> None:
        """New target weights, compiling nothing (``Engine.update_params``): the project's own parameter tree (a
        dict with ``embed_tokens``), or Tunix's Qwen3 NNX state (``nnx.State`` or its pure dict: mapped by
        ``tunix_params.from_tunix_qwen3``). Leaves are cast to the engine's dtypes (as Tunix's vanilla rollout casts
        to the rollout's precision). ``filter_types``: None, or ``nnx.Param`` (what Tunix's ``RLCluster.sync_weights``
        passes for full-weight training); LoRA (``nnx.LoRAParam``, a state of adapters only) is not supported."""
        if filter_types is not None:
            from flax import nnx
            types = filter_types if isinstance(filter_types, (tuple, list)) else (filter_types,)
            if not all(t is nnx.Param for t in types):
                raise NotImplementedError(f"update_params takes the full parameter state (filter_types None or "
                                          f"nnx.Param), got {filter_types!r}: LoRA states are not supported")
        if not (isinstance(params, dict) and "embed_tokens" in params):
            params = from_tunix_qwen3(params, self.engine.target.config)
        dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(
            self.engine.target.params)}
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(x, dtypes.get(jax.tree_util.keystr(p), getattr(x, "dtype", None))), params)
        self.engine.update_params(params)

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return self._eos

    def model(self) -> Target:
        """The target the engine decodes with (after ``update_params``: the new weights)."""
        return self.engine.target

    # -- text ----------------------------------------------------------------------------------------------------

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (or give token lists)")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))
