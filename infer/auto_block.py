"""``--block-size auto``: the block a run verifies, chosen for tokens per SECOND on the
device it runs on, not tokens per step.

Where a verify over 16 tokens costs about one plain step (an accelerator) the whole trained block wins; on a
CPU, where a forward's cost grows with its length, a shorter block can be faster. The rule: probe the run's
own prompts and options at each candidate block, which gives both one engine step's cost there and the
draft's per-position acceptance at that block (a draft accepts a little differently at each block: the demo draft's
8-token blocks accept 5.31 tokens a step where its 16-token blocks' first 8 positions predict 4.91), and take the
block of the largest expected tau / step cost. The probes decode
at most ``PROBE_ROWS`` of the prompts (evenly spread over them) as one batch, whatever the run's size, so their
cost is bounded. Probing is done on every call (nothing is cached across calls). The block is fixed before the
run samples anything, so the run is as lossless as at any fixed block (greedy: plain decoding's tokens).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from dflash_jax.decode.load_policy import drafting_blocks as candidates  # --block-size 1 is asked for by name
from dflash_jax.decode.load_policy import expected_tau, position_acceptance

PROBE_TOKENS = 96  # tokens per row of each probe run (fewer steps: costs and acceptance too noisy to choose by)
# Runs of fewer new tokens per row take the trained block unprobed: probing every candidate would cost more than
# the run, and see too few steps to choose by.
MIN_PROBED_TOKENS = PROBE_TOKENS // 2
# Prompts per probe batch: a few rows estimate a step's cost and the acceptance (200 prompts probed as one batch
# took most of a 17-minute run).
PROBE_ROWS = 4


def probe_prompts(prompts: list, rows: int = PROBE_ROWS) -> list:
    """At most ``rows`` of ``prompts``, evenly spread over them (the first and the last included)."""
    if len(prompts) <= rows:
        return list(prompts)
    return [prompts[i] for i in np.linspace(0, len(prompts) - 1, rows).round().astype(int)]


def worth_probing(trained: int, max_new_tokens: int) -> bool:
    """Whether a run of ``max_new_tokens`` per row with a draft trained at block ``trained`` is probed at all
    (else it verifies the trained block): there must be a choice, and a run long enough to pay for it."""
    return len(candidates(trained)) > 1 and max_new_tokens >= MIN_PROBED_TOKENS


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``--block-size auto`` measured and chose (printed, and in ``infer.benchmark --json``)."""

    block_size: int
    step_s: dict  # block -> seconds of one engine step (draft, verify, acceptance, cache updates)
    expected_tau: dict  # block -> expected acceptance length
    position_acceptance: dict  # block -> per block position, from that block's probe
    probe_steps: int
    probe_rows: int  # prompts decoded by each probe (``probe_prompts``)

    @property
    def expected_tokens_per_s(self) -> dict:
        return {k: self.expected_tau[k] / self.step_s[k] for k in self.step_s}

    def to_json(self) -> dict:
        return {"chosen": self.block_size, "step_s": self.step_s, "expected_tau": self.expected_tau,
                "expected_tokens_per_s": self.expected_tokens_per_s,
                "position_acceptance": self.position_acceptance, "probe_steps": self.probe_steps,
                "probe_rows": self.probe_rows}

    def describe(self) -> str:
        rates = ", ".join(f"{k}: {v:.0f}" for k, v in self.expected_tokens_per_s.items())
        return (f"--block-size auto chose {self.block_size} (expected tokens/s per block {rates}; step costs measured "
                f"here, acceptance from a {self.probe_steps}-step probe of {self.probe_rows} prompts; setup, not "
                "timed)")


def choose(step_s: dict, tau: dict) -> int:
    """The block of the largest expected tau (``tau``: block -> expected acceptance length) per second (ties: the
    shorter block)."""
    return max(sorted(step_s), key=lambda k: tau[k] / step_s[k])


def choose_block_size(target, draft, prompts, decoding_kw: dict) -> Choice:
    """Probe ``probe_prompts(prompts)`` with ``decoding_kw`` (``speculative_generate``'s options) at each
    candidate block: the run's own compiled program (one per block, as the real run needs), timed at a prefill-only
    budget and at ``PROBE_TOKENS``, so a step's cost is the engine's whole step (draft, verify, acceptance, cache
    updates); each block's probes estimate each position's acceptance at that block. Then choose."""
    from dflash_jax.decode import cache_length, speculative_generate

    trained, verify = draft.config.block_size, draft.config.verify_length
    budget = decoding_kw["max_new_tokens"]
    lens = [len(p) for p in prompts]
    blocks = candidates(trained)
    # every probe shares the real run's cache bucket, so the real run reuses the chosen block's program
    cache = cache_length(lens, [budget] * len(prompts), trained, decoding_kw.get("cache_len"))
    probed = probe_prompts(prompts)
    step_s, p, probe_steps = {}, {}, 0
    for k in blocks:
        run = functools.partial(speculative_generate, target, draft, probed, block_size=k,
                                **dict(decoding_kw, cache_len=cache))
        prefill = min(run(max_new_tokens=1)[0].wall_time_s for _ in range(3))
        probe = min((run(max_new_tokens=min(PROBE_TOKENS, budget)) for _ in range(2)), key=lambda r: r[0].wall_time_s)
        steps = max(max(len(r.acceptance_lengths) for r in probe), 1)
        step_s[k] = max(probe[0].wall_time_s - prefill, 1e-9) / steps
        p[k] = position_acceptance([(r.acceptance_lengths, verify(k)) for r in probe], verify(k))
        probe_steps += sum(len(r.acceptance_lengths) for r in probe)
    tau = {k: expected_tau(p[k], verify(k)) for k in blocks}
    return Choice(block_size=choose(step_s, tau), step_s=step_s, expected_tau=tau, position_acceptance=p,
                  probe_steps=probe_steps, probe_rows=len(probed))
