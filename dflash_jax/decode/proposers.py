"""What a decode step's draft proposes: one small interface, one implementation per proposal rule.

A proposer is a frozen (hashable) object, part of the compiled loop's static ``EngineSpec``; its runtime
inputs, if any (``arrays``), travel with the loop's other inputs. Each step it gets a ``StepView`` (the
block [pending token, mask...] per row, the committed lengths, the draft cache, per-row keys and sampling
settings) and returns a ``Proposal``: the draft tokens d_1..d_{K-1} and the log-weights of the
distribution q they were drawn from, which the rejection rule (``sampling.rejection_sample``) and the
adaptive verify length (``verify.verify_choice``) read. A sampled proposer still takes the argmax for rows
at temperature 0 (greedy rows in a mixed batch). Greedy decoding needs only the tokens;
its ``scores`` are the draft's plain (temperature 1) distribution, for the adaptive rule.

  * ``Chain``: DFlash v1, the argmax of the draft logits, or at temperature > 0 (rejection rule) a draw
    from the draft's processed distribution (temperature, top-k, top-p as the target's).
  * ``Selector``: DFlash2, the candidate-selector walk (``draft.select``); at temperature > 0 the walk
    samples from softmax(s / T) over the candidates and q is that, scattered onto the vocabulary (0 off
    the candidate list), so the rejection rule's residual is p minus q on the candidates.
  * ``Spark``: DSpark, the Markov walk (``draft.spark``) over the block's first K-1 slots (every slot drafts the
    token after it, the pending token's too); q_k is the Markov-corrected distribution given the drafted prefix
    (processed as the target's). With ``confidence_threshold`` > 0 a row's proposal stops before its first slot
    whose confidence is below it (``Proposal.length``; the verify stays K tokens, the cut is a mask).
  * benchmarks' replay draft: ``dflash_jax.synthetic.ReplayProposer``.

Tree verification (``tree_budget``) asks instead for ``propose_tree``: the best tree of N prefixes under
per-position distributions (``tree_logits``: the draft's v1 marginals; DSpark's Markov-corrected ones along its
greedy walk), fixed before the target's draws (``dflash_jax.tree``).

After verification the verified tokens' target features become draft context (``update_context``).
``for_draft`` picks the proposer of a draft's architecture from one registry (``PROPOSERS``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.drafts import model as draft_lib
from dflash_jax.drafts import dspark
from dflash_jax import tree as tree_lib
from dflash_jax.sampling import RowSampling, categorical, filtered_scores, if_sampling


@flax.struct.dataclass
class StepView:
    """What a proposer sees of one decode step (rows that are done propose too; their output is unused)."""

    tparams: Any
    dparams: Any
    block: jax.Array  # [B, K] int32: the pending token, then mask tokens
    lengths: jax.Array  # [B] committed tokens (the block's anchor position)
    block_len: jax.Array  # [B] block positions that can still be committed (the rest is left out)
    dcache: Any  # the draft's context cache (``draft.cache_kv``)
    key: jax.Array  # [B, 2] per-row keys
    sampling: RowSampling  # per row [B]
    args: Any = None  # the proposer's runtime arrays (``Proposer.arrays``)


@flax.struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, K-1] int32 draft tokens d_1..d_{K-1}
    scores: jax.Array  # [B, K-1, V] float32 log-weights of the distribution each d_k was drawn from
    length: Any = None  # [B] int32: drafts d_1..d_length proposed (a cut decided before each later draft); None: all


@dataclasses.dataclass(frozen=True)
class Proposer:
    """The interface; ``Chain`` below is DFlash v1's rule. ``sampled``: draw drafts from q (the rejection
    rule at temperature > 0) rather than take the most likely ones."""

    sampled: bool = False

    def arrays(self, spec, rows: int, cache_len: int):
        """Runtime inputs of ``propose`` (a pytree of host arrays, rows first), checked; None: none."""
        return None

    def admitted(self, spec, args, rows, streams):
        """Continuous batching (``decode.Engine.admit``): ``args`` once requests of key ``streams`` take slots
        ``rows``. The default keeps them: arrays that do not depend on the request (or none)."""
        return args

    def draft_forward(self, spec, view: StepView):
        """(draft logits [B, K-1, V] of block positions 1.., their final-normed hidden states)."""
        return draft_lib.block_logits(spec.target_config, view.tparams, spec.draft_config, view.dparams, view.block,
                                      view.lengths[:, None], *draft_lib.cache_kv(view.dcache), drop_anchor=True,
                                      decode_impl=spec.attention_impl, block_len=view.block_len, with_hidden=True)

    def propose(self, spec, view: StepView) -> Proposal:
        raise NotImplementedError

    def tree_logits(self, spec, view: StepView):
        """[B, K-1, V]: the per-position distributions a tree is built from: the v1 marginals (the draft logits).
        DFlash2 drafts too: the selector's candidate scores are conditional on the predecessor, not factorised."""
        return self.draft_forward(spec, view)[0]

    def propose_tree(self, spec, view: StepView, max_depth) -> tree_lib.Tree:
        """Tree verification's draft: the ``spec.tree_budget`` most probable prefixes (depth <= ``max_depth``
        [B]) under log_softmax(``tree_logits``), fp32, at any temperature (the draft alone fixes it: exact)."""
        logq = jax.nn.log_softmax(self.tree_logits(spec, view).astype(jnp.float32), axis=-1)
        return tree_lib.build_tree(logq, spec.tree_budget, max_depth, chain=True)

    def update_context(self, spec, dparams, dcache, features, positions):
        """Write the verified tokens' target ``features`` at ``positions`` (< 0: skipped) into the draft cache."""
        return draft_lib.materialize(spec.draft_config, dparams, dcache, features, positions)


@dataclasses.dataclass(frozen=True)
class Chain(Proposer):
    """DFlash v1: d_k = argmax of the draft logits at block position k, or a draw from the processed q_k."""

    def propose(self, spec, view: StepView) -> Proposal:
        logits, _ = self.draft_forward(spec, view)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if not self.sampled:
            return Proposal(best, logits)
        scores = filtered_scores(logits, view.sampling)
        greedy = (view.sampling.temperature == 0)[:, None]
        drawn = if_sampling(view.sampling.temperature, lambda: categorical(view.key, scores), best)
        return Proposal(jnp.where(greedy, best, drawn), scores)


@dataclasses.dataclass(frozen=True)
class Selector(Proposer):
    """DFlash2: the candidate-selector walk from the anchor (greedy: best candidate; sampled: softmax(s / T))."""

    def propose(self, spec, view: StepView) -> Proposal:
        logits, h = self.draft_forward(spec, view)
        temperature = view.sampling.temperature if self.sampled else None
        tokens, cand, s = draft_lib.select(spec.draft_config, view.dparams, h, logits, view.block[:, 0],
                                           temperature=temperature, key=view.key if self.sampled else None)
        t = 1.0 if temperature is None else jnp.maximum(temperature, 1e-6)[:, None, None]
        q = jax.nn.log_softmax(s / t, axis=-1)
        return Proposal(tokens, draft_lib.on_vocab(cand, q, logits.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Spark(Proposer):
    """DSpark: the Markov walk over slots 0..K-2 (greedy: the argmax of each corrected slot; sampled: a draw from
    it), cut at the first slot below ``confidence_threshold`` (> 0; needs the draft's confidence head)."""

    confidence_threshold: float = 0.0

    def draft_forward(self, spec, view: StepView):
        """(base logits [B, K-1, V] of every input slot, their hidden states): the slots are the pending token and
        K-2 masks (each drafts the token after it), never shortened at the end (DeepSpec's loop does not)."""
        return draft_lib.block_logits(spec.target_config, view.tparams, spec.draft_config, view.dparams,
                                      view.block[:, :-1], view.lengths[:, None], *draft_lib.cache_kv(view.dcache),
                                      decode_impl=spec.attention_impl, with_hidden=True)

    def propose(self, spec, view: StepView) -> Proposal:
        logits, h = self.draft_forward(spec, view)
        tokens, scores, confidence = draft_lib.spark(spec.draft_config, view.dparams, h, logits, view.block[:, 0],
                                                     sampling=view.sampling if self.sampled else None,
                                                     key=view.key if self.sampled else None)
        length = None
        if self.confidence_threshold > 0:
            length = dspark.confident_length(confidence, self.confidence_threshold)
        return Proposal(tokens, scores, length)

    def tree_logits(self, spec, view: StepView):
        """Slot k's Markov-corrected logits given the greedy drafts before it: the greedy walk's own scores (its
        chain is the tree's first path; a node off it is scored as if its prefix were the greedy one)."""
        logits, h = self.draft_forward(spec, view)
        return draft_lib.spark(spec.draft_config, view.dparams, h, logits, view.block[:, 0])[1]


PROPOSERS = {"dflash": Chain, "dflash2": Selector, "dspark": Spark}  # DraftConfig.architecture -> its rule


def for_draft(draft_cfg, sampled: bool, confidence_threshold: float = 0.0) -> Proposer:
    """The proposer a draft's architecture defines (``PROPOSERS``); ``confidence_threshold`` > 0 (DSpark drafts
    with a confidence head only) cuts each proposal at its first slot below it."""
    if draft_cfg.architecture not in PROPOSERS:
        raise ValueError(f"no proposer for draft architecture {draft_cfg.architecture!r} "
                         f"(known: {', '.join(PROPOSERS)})")
    if confidence_threshold > 0:
        if not draft_cfg.confidence_head:
            raise ValueError("confidence_threshold needs a DSpark draft with a confidence head")
        return PROPOSERS[draft_cfg.architecture](sampled=sampled, confidence_threshold=float(confidence_threshold))
    return PROPOSERS[draft_cfg.architecture](sampled=sampled)
