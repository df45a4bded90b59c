"""Every decoding option in one frozen object (``DecodeOptions``), checked once when it is built, and the
per-request overrides of continuous batching (``Request``)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Sequence

import numpy as np

from dflash_jax.attention import DECODE_IMPLS
from dflash_jax.families import family_of
from dflash_jax.sampling import SamplingParams
from dflash_jax.state import KVSpec

# How the checks name the options in their messages: the library's parameter names or, under ``option_names`` (the
# CLIs check under their flags' names, ``infer.flags.FLAGS``), the caller's: each rule is written once.
PARAMS = {**{name: name for name in ("max_new_tokens", "seed", "block_size", "attention_impl", "verify_lengths",
                                     "verify_threshold", "tree_budget", "confidence_threshold", "max_length",
                                     "cache_len")}, "draft": "a draft"}
_NAMES = contextvars.ContextVar("option_names", default=PARAMS)


@contextlib.contextmanager
def option_names(names: dict):
    """Within it, the option checks name each option as ``names`` does (the others keep their parameter names)."""
    token = _NAMES.set({**PARAMS, **names})
    try:
        yield
    finally:
        _NAMES.reset(token)


def named(option: str) -> str:
    """``option`` as the checks' messages name it now (see ``option_names``)."""
    return _NAMES.get()[option]


def check_budget_and_seed(max_new_tokens, seed) -> None:
    """``max_new_tokens`` >= 1 and ``seed`` in [0, 2**63): checked by every decode call and, before any weight
    is loaded, by the CLIs."""
    is_int = isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool)
    if not is_int or max_new_tokens < 1:
        raise ValueError(f"{named('max_new_tokens')} must be {'' if is_int else 'an integer '}>= 1, "
                         f"got {max_new_tokens!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"{named('seed')} must be an integer in [0, 2**63), got {seed!r}")


def resolve_block_size(block_size, trained: int | None) -> int:
    """The block to decode with: ``block_size`` in [1, ``trained``] (the draft's trained block; None: that
    block), or 1 without a draft (``trained`` None)."""
    if trained is None:
        if block_size not in (None, 1):
            raise ValueError(f"{named('block_size')} {block_size} needs {named('draft')}; plain decoding uses a "
                             "block of 1")
        return 1
    block_size = trained if block_size is None else block_size
    if not 1 <= block_size <= trained:
        raise ValueError(f"{named('block_size')} must be in [1, {trained}] (the draft was trained with block_size "
                         f"{trained}), got {block_size}")
    return block_size


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode (the keyword options of ``speculative_generate``), every value checked when built.

    ``acceptance``: "match" or "rejection" (speculative sampling; ``dflash_jax.sampling``) at temperature > 0.
    ``max_length`` caps prompt + generated tokens per row (default: the target's max_position_embeddings).
    ``proposer``: what each step drafts (``decode.proposers``; default: the draft architecture's own rule).
    ``attention_impl``: the decode attention (``attention.decode_attention``). ``cache_len``: at least this many
    cache slots per row. ``verify_lengths`` (e.g. (4, 8, 16)): adaptive verify at ``verify_threshold``.
    ``tree_budget`` N > 0: tree verification of the N most probable draft prefixes.
    ``confidence_threshold`` > 0 (DSpark drafts with a confidence head): each proposal stops before its first slot
    whose predicted acceptance is below it (0: off, as in DeepSpec). ``logprobs``: None (off), or k >= 0 (OpenAI's
    spelling): each result's ``logprobs`` holds the target's log-probability of every generated token at its
    row's temperature, taken from the verify forwards (no extra forward); k > 0 asks for no more (the alternatives
    at each position are the server's scoring: ``infer.serve.logprobs``)."""

    max_new_tokens: int
    block_size: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    max_length: int | None = None
    acceptance: str = "rejection"
    proposer: Any = None
    attention_impl: str = "auto"
    cache_len: int | None = None
    verify_lengths: tuple[int, ...] | None = None
    verify_threshold: float = 0.1
    tree_budget: int = 0
    confidence_threshold: float = 0.0
    logprobs: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (normalising a frozen field)
        set_("stop_token_ids", tuple(sorted({int(s) for s in (self.stop_token_ids or ())})))
        check_budget_and_seed(self.max_new_tokens, self.seed)
        self.sampling  # raises on a bad temperature / top-k / top-p / acceptance
        if self.attention_impl not in DECODE_IMPLS:
            raise ValueError(f"{named('attention_impl')} must be one of {', '.join(DECODE_IMPLS)}, "
                             f"got {self.attention_impl!r}")
        t = self.verify_threshold
        if not isinstance(t, (int, float, np.floating)) or isinstance(t, bool) or not np.isfinite(t):
            raise ValueError(f"{named('verify_threshold')} must be a finite number, got {t!r}")
        if self.verify_lengths is not None:
            set_("verify_lengths", tuple(sorted({int(x) for x in self.verify_lengths})))
        tb = self.tree_budget
        if not isinstance(tb, (int, np.integer)) or isinstance(tb, bool) or tb < 0:
            raise ValueError(f"{named('tree_budget')} must be an integer >= 0, got {tb!r}")
        if tb and self.verify_lengths is not None:
            raise ValueError(f"{named('tree_budget')} cannot be combined with {named('verify_lengths')}")
        c = self.confidence_threshold
        if not isinstance(c, (int, float, np.floating)) or isinstance(c, bool) or not 0 <= c < 1:
            raise ValueError(f"{named('confidence_threshold')} must be a number in [0, 1), got {c!r}")
        check_logprobs(self.logprobs)
        for name in ("max_length", "cache_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"{named(name)} must be a positive integer, got {v!r}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.acceptance)

    def replace(self, **kw) -> "DecodeOptions":
        return dataclasses.replace(self, **kw)

    def block_for(self, draft) -> int:
        """The tokens a step verifies with this draft (None: plain decoding, 1), checked (``check_draft``)."""
        return self.check_draft(None if draft is None else draft.config)

    def check_draft(self, dcfg) -> int:
        """The tokens a step verifies with a draft of config ``dcfg`` (None: plain decoding, 1): the block size, or
        for a DSpark draft (every slot drafts) its ``block_size`` input slots + 1; raises where an option asks what
        this draft cannot do. The CLIs call it with the draft's config before loading any weight."""
        block = resolve_block_size(self.block_size, dcfg.block_size if dcfg is not None else None)
        if dcfg is not None:
            block = dcfg.verify_length(block)
        if self.proposer is not None and (dcfg is None or block == 1):
            raise ValueError("a proposer needs a draft")
        if self.tree_budget and block == 1:
            raise ValueError(f"{named('tree_budget')} needs a draft and a block size > 1")
        if dcfg is not None and dcfg.shifted and self.verify_lengths is not None:
            raise ValueError(f"{named('verify_lengths')} is not supported for DSpark drafts (their confidence head "
                             f"cuts the proposal instead: {named('confidence_threshold')})")
        if self.tree_budget and self.confidence_threshold:
            raise ValueError(f"{named('confidence_threshold')} cuts a chain's proposal; it cannot be combined with "
                             f"{named('tree_budget')}")
        if self.confidence_threshold and not (dcfg is not None and dcfg.confidence_head):
            raise ValueError(f"{named('confidence_threshold')} needs a DSpark draft with a confidence head")
        if dcfg is not None:
            self.verify_lengths_for(block)
        return block

    def max_block(self, draft) -> int:
        """The most tokens one forward writes that may be rolled back (``block_for``, or a tree's N + 1): what sliding
        rings and recurrent stashes are sized for."""
        return max(self.block_for(draft), self.tree_budget + 1)

    def verify_lengths_for(self, block: int) -> tuple[int, ...] | None:
        """The adaptive verify lengths as the engine takes them (None: always the whole block), checked."""
        lengths = self.verify_lengths
        if lengths is None:
            return None
        if block == 1:
            raise ValueError(f"{named('verify_lengths')} needs a draft and a block size > 1")
        if not lengths or lengths[0] < 1 or lengths[-1] > block:
            raise ValueError(f"{named('verify_lengths')} must be in [1, {block}] (the block size), got {list(lengths)}")
        return None if lengths == (block,) else lengths

    def limit(self, target_config) -> int:
        """The most tokens (prompt + generated) a row may hold."""
        return self.max_length or target_config.max_position_embeddings


def check_logprobs(logprobs) -> None:
    """``logprobs``: None or an integer >= 0 (True / False are refused: 0 asks for the chosen tokens' values)."""
    if logprobs is not None and (not isinstance(logprobs, (int, np.integer)) or isinstance(logprobs, bool)
                                 or logprobs < 0):
        raise ValueError(f"logprobs must be None or an integer >= 0 (0: each generated token's log-probability), "
                         f"got {logprobs!r}")


def check_tree_target(cfg, block_size: int) -> None:
    """Tree verification needs sliding windows >= the block (the tree's own keys get no window): a ValueError
    names a narrower one. Full attention, kv-shared and recurrent (Gated DeltaNet) layers all verify trees."""
    for i, s in enumerate(family_of(cfg).state_specs(cfg)):
        if not isinstance(s, KVSpec):  # kv-shared layers attend to an earlier layer's keys; recurrent: stashed
            continue
        if s.window is not None and s.window < block_size:
            raise ValueError(f"{named('tree_budget')} > 0 needs sliding windows >= the block size {block_size}: layer "
                             f"{i} has a sliding window of {s.window}; use the chain ({named('tree_budget')} 0) or a "
                             "smaller block")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt for continuous batching (``decode.Engine.admit``, ``continuous_generate``), with settings of its
    own; None takes the engine's ``DecodeOptions``. ``seed`` with ``stream``: the row's key is
    fold_in(PRNGKey(seed), stream) (row i of a batch call with seed s is (s, i)), so a request draws the same
    tokens whatever batch it lands in."""

    prompt_ids: Sequence[int]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: int = 0
    stop_token_ids: Sequence[int] | None = None
    logprobs: int | None = None  # ``DecodeOptions.logprobs``: this request's tokens' log-probabilities
    grammar: Any = None  # a ``dflash_jax.grammar.Grammar`` its output must match (an engine with a tokenizer)

    def settings(self, options: DecodeOptions) -> DecodeOptions:
        """The options this request decodes with (its own values over ``options``), checked."""
        own = {f: getattr(self, f) for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                             "stop_token_ids", "logprobs") if getattr(self, f) is not None}
        return options.replace(**own) if own else options

    def group(self, n: int) -> list["Request"]:
        """``n`` samples of this prompt (a GRPO group): the same request on key streams stream * n + j, so each
        draws its own tokens, the group is reproducible with a ``seed``, and an engine with prefix caching prefills
        the prompt once (the later rows share its pages)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a group needs n >= 1 samples, got {n!r}")
        return [dataclasses.replace(self, stream=self.stream * n + j) for j in range(n)]
