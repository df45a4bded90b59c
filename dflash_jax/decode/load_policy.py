"""Speculation that follows the load: each ``Engine.run`` verifies, for its bucket of live rows, the block of the
most expected committed tokens per second (``BlockPolicy``), from step costs measured per (bucket, block) at start-up
and a running estimate of the draft's per-position acceptance at each block (``Acceptance``, one per engine: every
request's steps). Block 1 is plain decoding that still writes the draft's context, so the next drafting step drafts
from every committed token. Any block is lossless, so switching between steps keeps the output exact (greedy: plain
decoding's tokens; sampled: the target's law).

Why: verifying a block of K tokens costs up to K plain steps where a step is compute-bound (a CPU at any batch, an
accelerator at many rows), so the block that wins at one row can lose to plain decoding at 64."""
from __future__ import annotations

import dataclasses

import numpy as np

# A weak prior on each position's acceptance (PRIOR, worth PRIOR_WEIGHT steps): a strong one compounds over a
# long block's positions, each seen in few steps, and biases the choice toward short blocks.
PRIOR, PRIOR_WEIGHT = 0.5, 0.1
MEMORY_STEPS = 2048  # the running acceptance forgets with this time constant (in observed verify steps)
# The running acceptance of a block position is its own steps' over a prior worth START_WEIGHT steps: the position's
# estimate over the other blocks' steps (a draft accepts a little differently at each block: the demo draft's 8-token
# blocks accept 5.31 tokens a step where its 16-token blocks' first 8 positions predict 4.91), itself over the estimate
# of the position before it, START before the first. So a block seldom run is judged by the others' steps at its
# positions, a position past every block run so far follows the ones before it (a fixed 0.7 there kept a server at
# block 4, expecting 5.7 tokens a step at block 16, which gave 8.2), and an engine that has seen nothing expects
# every token accepted, so its first steps draft the block that is best if they are. Firm enough that one rejected
# step does not turn drafting off (measured: a start worth 0.1 steps did, for good).
START, START_WEIGHT = 1.0, 8.0
# Plain steps teach nothing, so after this many of them in a row a policy drafts for one short run (at the
# bucket's best drafting block, at most EXPLORE_RUN_STEPS steps): the estimate follows traffic that changed.
EXPLORE_EVERY, EXPLORE_RUN_STEPS = 512, 2


def drafting_blocks(block: int) -> tuple[int, ...]:
    """4, 8, 16, 32 below ``block``, and ``block``: the drafting blocks an automatic choice considers (block 1, plain
    decoding, only where a policy may step plainly: ``candidates``)."""
    return tuple(sorted({block} | {k for k in (4, 8, 16, 32) if k < block}))


def candidates(block: int) -> tuple[int, ...]:
    """The blocks a policy chooses from: 1 (plain steps) and ``drafting_blocks``."""
    return tuple(sorted({1, *drafting_blocks(block)}))


def position_acceptance(runs, block: int) -> list[float]:
    """P(draft token k is accepted | tokens 1..k-1 were), k = 1..block-1, from ``runs``: (acceptance lengths,
    each counting the bonus token, of steps verifying K tokens; K) pairs. A step of length a accepted tokens
    1..a-1 and, when a < K, rejected token a (at a = K the rest is unseen)."""
    reached, accepted = np.zeros(block), np.zeros(block)
    for lengths, k in runs:
        r, a = _counts(np.asarray(lengths, np.int64), np.full(len(lengths), k), block)
        reached, accepted = reached + r, accepted + a
    return [float(x) for x in _posterior(reached, accepted)]


def _counts(lengths, verified, block: int):
    """(steps where token j was judged, steps where it was accepted), j = 0..block-1 (j = 0 unused), from steps of
    acceptance ``lengths`` verifying ``verified`` tokens each."""
    j = np.arange(block)[None]
    judged = (lengths[:, None] >= j) & (j < verified[:, None]) & (j >= 1)
    return judged.sum(0).astype(np.float64), (judged & (lengths[:, None] >= j + 1)).sum(0).astype(np.float64)


def _posterior(reached, accepted, prior: float = PRIOR, weight: float = PRIOR_WEIGHT):
    return ((accepted + prior * weight) / (reached + weight))[1:]


def expected_tau(p, block: int) -> float:
    """Expected acceptance length (bonus included) of a step verifying ``block`` tokens: 1 + sum over k < block
    of P(tokens 1..k all accepted)."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(p[:block - 1], np.float64)))) if block > 1 else 1.0


class Acceptance:
    """The draft's running per-position acceptance at each verify length, over every request's verify steps: counts
    that forget with a time constant of ``memory`` steps (every block's at every observed step, so a block left
    unused drifts back to what the others' steps say), so the estimate follows the traffic."""

    def __init__(self, memory: int = MEMORY_STEPS):
        self.memory = memory
        self.reached: dict[int, np.ndarray] = {}  # verify length k -> [k] counts, position j judged (j = 0 unused)
        self.accepted: dict[int, np.ndarray] = {}
        self.steps = 0

    def observe(self, acceptance_lengths, verify_lengths) -> None:
        """One request's steps: acceptance lengths and the tokens each verified (plain steps: nothing to learn).
        Its last step is left out (cut by the budget or a stop token, it would read as a rejection)."""
        a = np.asarray(acceptance_lengths, np.int64)[:-1]
        v = np.asarray(verify_lengths, np.int64)[:len(a)]
        a, v = a[v > 1], v[v > 1]
        if not len(a):
            return
        keep = np.exp(-len(a) / self.memory)
        for k in self.reached:
            self.reached[k], self.accepted[k] = self.reached[k] * keep, self.accepted[k] * keep
        for k in np.unique(v).tolist():
            r, acc = _counts(a[v == k], v[v == k], k)
            self.reached[k] = self.reached.get(k, 0.0) + r
            self.accepted[k] = self.accepted.get(k, 0.0) + acc
        self.steps += len(a)

    def p(self, block: int) -> np.ndarray:
        """P(token j accepted | 1..j-1 were) at steps verifying ``block`` tokens, j = 1..block-1: the block's own
        counts over a prior worth ``START_WEIGHT`` steps, the position's estimate over the other blocks' steps (each
        of those over the estimate of the position before it; ``START`` before the first), so a block seldom run
        is judged by the others' steps at its positions and a position none reached follows the ones before it."""
        reached, accepted = np.zeros(block), np.zeros(block)
        for k in (k for k in self.reached if k != block):
            n = min(k, block)
            reached[:n], accepted[:n] = reached[:n] + self.reached[k][:n], accepted[:n] + self.accepted[k][:n]
        own_r, own_a = self.reached.get(block, np.zeros(block)), self.accepted.get(block, np.zeros(block))
        out, pooled = np.empty(block - 1), START
        for j in range(1, block):
            pooled = (accepted[j] + pooled * START_WEIGHT) / (reached[j] + START_WEIGHT)
            out[j - 1] = (own_a[j] + pooled * START_WEIGHT) / (own_r[j] + START_WEIGHT)
        return out

    def tau(self, block: int) -> float:
        """Expected acceptance length (bonus included) of a step verifying ``block`` tokens."""
        return expected_tau(self.p(block), block) if block > 1 else 1.0


@dataclasses.dataclass
class BlockPolicy:
    """The block each bucket of live rows verifies: of the ``candidates``, the one of the most expected tokens per
    second, ``acceptance.tau(k)`` / step_s[bucket, k] (k = 1: one token per plain step), so a step never costs more than
    its expected gain allows. Never longer at more rows, and no cliff: a bucket's block is at most one step of the
    ``ladder`` longer than the next larger bucket's (the choice moves one block size at a time as rows are added;
    with a rate that rises then falls in k, each capped choice is still at least plain decoding's rate). ``step_s``:
    (bucket, k) -> seconds of one engine step (``Engine.probe_costs``); a bucket not measured takes the choice of
    the largest measured one below it. After ``EXPLORE_EVERY`` plain steps in a row one short run drafts
    (``exploring``; the engine cuts it to ``EXPLORE_RUN_STEPS`` steps and reports every run to ``ran``)."""

    step_s: dict
    acceptance: Acceptance
    plain_steps: int = 0  # plain steps since the last drafting one
    exploring: bool = False  # the last ``choose`` drafts only to learn
    _table: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # (its inputs, ``table()``)

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted({k for _, k in self.step_s}))

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self.step_s}))

    def rates(self, bucket: int) -> dict:
        """Block -> expected committed tokens per second of one row at ``bucket`` rows."""
        return {k: self.acceptance.tau(k) / self.step_s[bucket, k] for k in self.blocks if (bucket, k) in self.step_s}

    def table(self) -> dict:
        """Bucket -> the block its steps verify (measured buckets); computed again only when the costs or the
        acceptance counts changed (every engine run asks)."""
        key = (tuple(self.step_s.items()), self.acceptance.steps)  # the counts change only with the steps observed
        if self._table is None or self._table[0] != key:
            self._table = (key, self._choose_table())
        return dict(self._table[1])

    def ladder(self) -> tuple[int, ...]:
        """The blocks a choice steps through: each expected to commit more tokens a step than every shorter one (a
        longer block costs at least as much, so one that commits no more never pays: a draft may accept less of an
        8-token block than of a 4-token one)."""
        out, most = [], 0.0
        for k in self.blocks:
            tau = self.acceptance.tau(k)
            if tau > most:
                out.append(k)
                most = tau
        return tuple(out)

    def _choose_table(self) -> dict:
        blocks, best, top = self.ladder(), {}, None
        for b in self.buckets:  # each bucket's best (ties: the shorter block), never longer than a smaller bucket's
            rates = {k: r for k, r in self.rates(b).items() if k in blocks}
            i = blocks.index(max(sorted(rates), key=rates.get))
            best[b] = top = i if top is None else min(i, top)
        out, cap = {}, None
        for b in sorted(best, reverse=True):  # at most one size longer than the next larger bucket's
            cap = best[b] if cap is None else min(best[b], cap + 1)
            out[b] = blocks[cap]
        return dict(sorted(out.items()))

    def measured(self, bucket: int) -> int:
        """The measured bucket whose choice a run of ``bucket`` rows takes (the largest at or below it)."""
        below = [b for b in self.buckets if b <= bucket]
        return below[-1] if below else min(self.buckets)

    def block_for(self, bucket: int) -> int:
        """The table's block for a run of ``bucket`` rows (what ``/metrics`` shows; no exploring, no state)."""
        return self.table()[self.measured(bucket)]

    def choose(self, bucket: int) -> int:
        """The block a run of ``bucket`` rows verifies: ``block_for``, or a drafting one when exploring is due."""
        block = self.block_for(bucket)
        self.exploring = block == 1 and self.plain_steps >= EXPLORE_EVERY and len(self.blocks) > 1
        if self.exploring:
            rates = self.rates(self.measured(bucket))
            block = max(sorted(k for k in rates if k > 1), key=rates.get)
        return block

    def ran(self, block: int, steps: int) -> None:
        """A run of ``steps`` steps at ``block`` happened (plain ones count toward exploring)."""
        self.plain_steps = self.plain_steps + steps if block == 1 else 0

    def observe(self, results) -> None:
        """Finished requests' steps (``GenerationResult``s) into the running acceptance."""
        for r in results:
            self.acceptance.observe(r.acceptance_lengths, r.verify_lengths)

    def describe(self) -> str:
        """One line: the block per bucket and what chose it."""
        table = ", ".join(f"{b} rows: {'plain' if k == 1 else k}" for b, k in self.table().items())
        taus = ", ".join(f"{k}: {self.acceptance.tau(k):.2f}" for k in self.blocks if k > 1)
        return (f"block per bucket of live rows (--block-size auto): {table} (expected tau per block {taus}, over "
                f"{self.acceptance.steps} observed steps)")
