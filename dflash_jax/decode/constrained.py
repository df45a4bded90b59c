"""Structured outputs in an engine: the grammar matchers of its constrained rows (``Request.grammar``), the host
between a constrained step's draft and its verify.

A constrained step (``Engine.run`` while such a row runs) is two programs: ``steps.propose_rows`` drafts the
proposal and returns it (its tokens come to the host, its scores stay on the device); each constrained row's
matcher gives the bitmask of every verified position along the proposal (position i: after the committed tokens
and d_1..d_i; past the first forbidden draft token all ones, since the masked target rejects that token and nothing
after it is committed); ``steps.step_rows`` verifies against the masked target and commits. The matchers then
consume what was committed, read back before the next step. Rows without a grammar share the step, unmasked."""
from __future__ import annotations

import numpy as np

from dflash_jax import sharding
from dflash_jax.decode import steps
from dflash_jax.grammar import Grammars, RowMatcher


class Constraints:
    """Per row: its grammar's matcher, which has consumed ``consumed`` of the row's generated tokens."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars: Grammars | None = None
        self.rows: dict[int, RowMatcher] = {}
        self.guided: set[int] = set()  # greedy rows: proposals rebuilt along the grammar

    @property
    def grammars(self) -> Grammars:
        """The compiler (built at the first grammar: llguidance's tokenizer costs about a second to build)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("a request with a grammar needs an engine built with its tokenizer "
                                 "(Engine(..., tokenizer=...), continuous_generate(..., tokenizer=...))")
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def check(self, grammar, spec, index: int) -> None:
        """``grammar`` compiles and the engine can follow it, else ValueError naming the request."""
        if spec.tree_budget or spec.verify_lengths:
            raise ValueError(f"request {index}: a grammar needs chain verification of the whole block (tree_budget=0, "
                             "no verify_lengths): its masks follow one proposal")
        try:
            self.grammars.compile(grammar)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from e

    def start(self, row: int, grammar, first: bool, greedy: bool) -> np.ndarray | None:
        """``row`` now matches ``grammar`` (None: unconstrained) from its first generated token -> that token's
        bitmask [words] (``first``; a row re-admitted after preemption draws no new first token: None). A ``greedy``
        row's proposals are rebuilt to follow the grammar (``RowMatcher.masks``)."""
        self.rows.pop(row, None)
        self.guided.discard(row)
        if grammar is None:
            return None
        matcher = self.rows[row] = self.grammars.matcher(grammar)
        if greedy:
            self.guided.add(row)
        if not first:
            return None
        out = np.empty((1, matcher.words), np.int32)
        matcher.masks([], out)
        return out[0]

    def forget(self, row: int) -> None:
        self.rows.pop(row, None)
        self.guided.discard(row)

    def live(self, rows) -> bool:
        return any(int(r) in self.rows for r in rows)

    def catch_up(self, state, prompt_lengths: dict[int, int], width: int) -> None:
        """Every matcher advanced by the tokens its row generated since (``width``: the most one step or admission
        commits; a row re-admitted after preemption reads its whole row once)."""
        out = sharding.to_host(steps.recent_jit(state, width, 1))
        for row, matcher in self.rows.items():
            new = int(out["generated"][row]) - matcher.consumed
            if new <= 0:
                continue
            if new <= width:
                tokens = out["tail"][row, width - new:]
            else:
                start = prompt_lengths[row] + matcher.consumed
                tokens = np.asarray(sharding.to_host(state.tokens[row]))[start:start + new]
            matcher.advance(tokens)

    def masks(self, at, proposal, candidates, k: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(the proposal [A, k-1], greedy rows' rebuilt along their grammars (None: plain steps, k = 1), the bitmasks
        [A, k, words] int32 of each row ``at``'s k verified positions along it: all ones for rows without a
        grammar). ``candidates`` [A, k-1, C]: the draft's most probable tokens at each position."""
        out = np.full((len(at), k, self.grammars.words), -1, np.int32)
        proposal = None if proposal is None else np.array(proposal)
        for i, row in enumerate(at):
            matcher = self.rows.get(int(row))
            if matcher is None:
                continue
            if proposal is None:
                matcher.masks([], out[i])
            else:
                guide = candidates[i] if int(row) in self.guided else None
                proposal[i] = matcher.masks(proposal[i], out[i], guide)
        return proposal, out
