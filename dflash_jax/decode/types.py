"""What a compiled decode program is bound to (``EngineSpec``), what it carries (``DecodeState``), and what it
returns per row (``GenerationResult``, ``Finish``)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import flax.struct
import jax
import numpy as np

from dflash_jax import sharding
from dflash_jax.drafts import DraftConfig
from dflash_jax.sampling import RowSampling
from dflash_jax.state import PAGE_AXES, PagedKV, Stacked


def _pin_pools(k, v, page: int, mesh):
    """One paged layer's pools (a scanned group's: stacked, layer-first) pinned: KV heads over tensor."""
    pools = PagedKV(k, v, None, page)
    pinned = sharding.constrain_state(Stacked(pools), mesh).inner if k.ndim > len(PAGE_AXES) else \
        sharding.constrain_state(pools, mesh)
    return pinned.k, pinned.v


class Finish(enum.IntEnum):
    """Why a row stopped (its ``DecodeState.finish``): every value but RUNNING is a row that no step changes."""

    RUNNING = 0
    LENGTH = 1  # its token budget (max_new_tokens, or the max length) is spent
    STOP = 2  # it committed a stop token
    FREE = 3  # a slot holding no request (never admitted, or released)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about a compiled decode program (the one frozen object its functions are bound to)."""

    target_config: Any  # the target's config (any family)
    draft_config: DraftConfig | None
    block_size: int
    greedy: bool  # every row is greedy (argmax everywhere, no keys used); else per row: temperature 0 = greedy
    mesh: Any = None  # jax.sharding.Mesh the params live on (None: one device); rows and caches go over data
    acceptance: str = "rejection"  # "match" | "rejection" (sampling.py); greedy rows always match
    proposer: Any = None  # what a step drafts (``decode.proposers``); None: plain decoding
    attention_impl: str = "auto"  # target decode / verify and draft attention (``attention.decode_attention``)
    verify_lengths: tuple[int, ...] | None = None  # adaptive verify: the lengths a step may verify (None: the block)
    tree_budget: int = 0  # tree verification with this many draft nodes (``verify.tree_verify``); 0: the chain
    cache_len: int = 0  # cache slots per row (positions 0..cache_len-1)
    stop_width: int = 8  # stop ids per row (padded with -1)
    page: int = 0  # > 0: full-attention caches paged, pages of this many tokens (``state.PagedKV``); 0: per row
    # the tokens this program's steps verify, in [1, block_size] (``decode.load_policy``'s choice for a bucket of rows;
    # 1: plain steps that still write the draft's context); 0: block_size. Caches are sized by block_size either way
    load_block: int = 0
    # steps write each committed token's log-probability (``DecodeState.logps``; the prefill always writes the first)
    logprobs: bool = False

    def place(self, state: "DecodeState") -> "DecodeState":
        """Pin the decode state's layout on the mesh (rows over data*fsdp, KV heads over tensor)."""
        if self.mesh is None:
            return state
        names = ROW_FIELDS + (("pages",) if state.pages is not None else ())
        rows = sharding.constrain_batch(tuple(getattr(state, n) for n in names), self.mesh)
        pools = state.pools and tuple(  # each paged layer's pools: KV heads over tensor (``state.PAGE_AXES``)
            tuple(_pin_pools(k, v, self.page, self.mesh) for k, v in group) for group in state.pools)
        return state.replace(**dict(zip(names, rows)), pools=pools,
                             tcache=sharding.constrain_cache(state.tcache, self.mesh),
                             dcache=sharding.constrain_cache(state.dcache, self.mesh))

    @property
    def speculative(self) -> bool:
        return self.draft_config is not None and self.block_size > 1

    @property
    def step_block(self) -> int:
        """The tokens a step of this program verifies (``load_block``, else the block)."""
        return self.load_block or self.block_size

    @property
    def drafting(self) -> bool:
        """Steps propose tokens: a draft and a step block > 1 (a draft's plain steps still write its context)."""
        return self.speculative and self.step_block > 1

    def at_block(self, k: int) -> "EngineSpec":
        """This spec with steps verifying ``k`` tokens (same caches, same state: one program per k)."""
        if not self.speculative or self.tree_budget or self.verify_lengths or not 1 <= k <= self.block_size:
            raise ValueError(f"steps of {k} tokens need a chain draft of block >= {k} without adaptive verify")
        return dataclasses.replace(self, load_block=0 if k == self.block_size else int(k))

    @property
    def draft_block(self) -> int:
        """The block as the draft's ``block_size`` counts it: the tokens verified, or a DSpark draft's input
        slots (one fewer: every slot drafts the token after it)."""
        shifted = self.speculative and self.draft_config.shifted
        return self.block_size - 1 if shifted else self.block_size

    @property
    def rejection(self) -> bool:
        return self.drafting and not self.greedy and self.acceptance == "rejection" and not self.tree_budget

    @property
    def lengths(self) -> tuple[int, ...]:
        """The verify lengths a step chooses from (one static forward each)."""
        return self.verify_lengths or (self.step_block,)

    @property
    def max_block(self) -> int:
        """The most tokens one verify forward writes (a sliding ring holds them beside its window)."""
        return max(self.block_size, self.tree_budget + 1)

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return self.draft_config.target_layer_ids if self.speculative else ()


@flax.struct.dataclass
class Inputs:
    """A program's runtime inputs shared by every row."""

    tparams: Any
    dparams: Any  # None for plain decoding
    mask_token_id: jax.Array
    threshold: jax.Array  # the adaptive verify rule's (``verify.verify_choice``; unused with one verify length)
    proposer_args: Any = None  # the proposer's runtime arrays (``Proposer.arrays``; rows first)


@flax.struct.dataclass
class Rows:
    """New rows for a prefill (``steps.prefill``; rows first): prompts, budgets and per-row settings."""

    prompts: jax.Array  # [A, P] int32, padded to a bucket: each prompt from ``start`` on (what the prefill runs)
    lens: jax.Array  # [A] prompt lengths
    start: jax.Array  # [A] positions the row's pages already hold (a cached prefix; 0: none)
    budget: jax.Array  # [A] most tokens each row may generate
    stop_ids: jax.Array  # [A, W] int32 stop ids, padded with -1
    sampling: RowSampling  # [A] each row's sampling settings
    key: jax.Array  # [A, 2] uint32: each row's own key
    allowed: Any = None  # [A, words] int32: each row's grammar bitmask of its first token (None: no row constrained)


@flax.struct.dataclass
class DecodeState:
    """S rows of decoding (rows first, every leaf): caches, committed tokens, per-row settings and counters."""

    tokens: jax.Array  # [B, S] tokens by position; tokens[b, n_b] is the pending (not yet cached) token
    tcache: Any  # target layer states (``state.LayerStates``); lengths = n, the committed tokens they hold
    dcache: Any  # draft context K/V (None: plain decoding); lengths == tcache.lengths at every step
    prompt_len: jax.Array  # [B] the row's prompt length
    generated: jax.Array  # [B] tokens generated so far, the pending one included
    budget: jax.Array  # [B] most tokens the row may generate
    finish: jax.Array  # [B] int32 ``Finish``
    acceptance: jax.Array  # [B, S] acceptance length of each verify step
    verified: jax.Array  # [B, S] tokens each verify step's target forward ran on (its verify length)
    steps: jax.Array  # [B] verify steps taken
    key: jax.Array  # [B, 2] each row's key
    stop_ids: jax.Array  # [B, W]
    sampling: RowSampling  # [B] each row's settings (a free row's: greedy)
    # [B, S] float32 by position, as ``tokens``: log p(tokens[b, t] | tokens[b, :t]) at the row's temperature, for
    # the generated positions (written by the prefill, and by steps of a ``logprobs`` spec)
    logps: jax.Array
    pages: Any = None  # [B, columns] int32, paged caches (``EngineSpec.page``): each row's block table; else None
    pools: Any = None  # paged caches: (target pools, draft pools), a (k, v) pair per paged layer; not rows first

    @property
    def done(self):
        return self.finish != Finish.RUNNING


ROW_FIELDS = ("tokens", "prompt_len", "generated", "budget", "finish", "acceptance", "verified", "steps", "key",
              "stop_ids", "sampling", "logps")


@dataclasses.dataclass
class GenerationResult:
    """One row's output. ``output_ids`` = prompt + generated ids (after a stop token: nothing)."""

    output_ids: list[int]
    prompt_length: int
    acceptance_lengths: list[int]
    verify_lengths: list[int]  # tokens each verify step's target forward ran on (the block, or the adaptive choice)
    target_forwards: int  # prefill + verify steps
    finish_reason: str
    wall_time_s: float  # the request's decode: its prefill until its last token reached the host
    tokens_per_second: float
    time_to_first_token_s: float | None = None  # streaming only: prefill until the first token reached the host
    queue_time_s: float | None = None  # continuous batching: the run's start until its admission (prefill) began
    cached_tokens: int = 0  # prompt tokens read from cached pages (a shared prefix), not prefilled
    # asked for (``Request.logprobs``): one per generated token, the target's log-probability of it under the
    # distribution its row sampled from (log_softmax(logits / temperature); greedy: temperature 1); else None
    logprobs: list[float] | None = None

    @property
    def generated_ids(self) -> list[int]:
        return self.output_ids[self.prompt_length:]

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) - self.prompt_length

    @property
    def mean_acceptance_length(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    def to_json(self) -> dict:
        out = {"output_ids": self.output_ids, "prompt_length": self.prompt_length,
               "generated_ids": self.generated_ids, "num_generated": self.num_generated,
               "acceptance_lengths": self.acceptance_lengths, "verify_lengths": self.verify_lengths,
               "tau": self.mean_acceptance_length,
               "target_forwards": self.target_forwards, "finish_reason": self.finish_reason,
               "wall_time_s": self.wall_time_s, "tokens_per_second": self.tokens_per_second,
               "time_to_first_token_s": self.time_to_first_token_s, "queue_time_s": self.queue_time_s}
        return out | ({"logprobs": self.logprobs} if self.logprobs is not None else {})


def row_result(host: dict, i: int, prompt_length: int, wall: float, logprobs: bool = False,
               **timing) -> GenerationResult:
    """Row ``i`` of a state read to the host (``host``: tokens, generated, acceptance, verified, steps, finish,
    logps); ``logprobs``: the row asked for its tokens' log-probabilities."""
    g, s = int(host["generated"][i]), int(host["steps"][i])
    if logprobs:
        timing["logprobs"] = host["logps"][i, prompt_length:prompt_length + g].tolist()
    return GenerationResult(
        output_ids=host["tokens"][i, :prompt_length + g].tolist(), prompt_length=int(prompt_length),
        acceptance_lengths=host["acceptance"][i, :s].tolist(), verify_lengths=host["verified"][i, :s].tolist(),
        target_forwards=s + 1, finish_reason=Finish(int(host["finish"][i])).name.lower(), wall_time_s=wall,
        tokens_per_second=g / wall if wall > 0 else float("inf"), **timing)


def to_host(state: DecodeState, logprobs: bool = False) -> dict:
    """The fields ``row_result`` reads, on the host (``logprobs``: the log-probabilities too)."""
    names = ("tokens", "generated", "acceptance", "verified", "steps", "finish") + (("logps",) if logprobs else ())
    return dict(zip(names, sharding.to_host(tuple(getattr(state, n) for n in names))))
