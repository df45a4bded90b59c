"""Structured outputs in an engine: the grammar matchers of its constrained rows (``Request.grammar``), the host
between a constrained step's draft and its verify.

A constrained step (each step of an ``Engine.run`` while such a row runs) is two programs: ``steps.propose_rows``
drafts the proposal and returns it (its tokens come to the host, its scores stay on the device); each constrained row's
matcher gives the bitmask of every verified position along the proposal (position i: after the committed tokens
and d_1..d_i; past the first forbidden draft token all ones, since the masked target rejects that token and nothing
after it is committed); ``steps.step_rows`` verifies against the masked target and commits. The matchers then
consume what was committed, read back before the next step. Rows without a grammar share the step, unmasked."""
from __future__ import annotations

import numpy as np

from dflash_jax import sharding
from dflash_jax.grammar import Grammars, RowMatcher, fill_masks


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

    def check(self, grammar, spec) -> None:
        """``grammar`` compiles and the engine can follow it, else ValueError saying why."""
        if spec.tree_budget or spec.verify_lengths:
            raise ValueError("a grammar needs chain verification of the whole block (tree_budget=0, no "
                             "verify_lengths): its masks follow one proposal")
        self.grammars.compile(grammar)

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
        return matcher.first_mask() if first else None

    def forget(self, row: int) -> None:
        self.rows.pop(row, None)
        self.guided.discard(row)

    def live(self, rows) -> bool:
        return any(int(r) in self.rows for r in rows)

    def catch_up(self, at, tail, generated, state) -> None:
        """The matchers of the rows ``at`` advanced by the tokens each generated since: ``tail`` [A, W] its last W
        tokens (W: the most one step or admission commits), ``generated`` [A] its count (``steps.recent``); a row
        re-admitted after preemption reads its whole row from ``state`` once."""
        width = tail.shape[1]
        for i, row in enumerate(int(r) for r in at):
            matcher = self.rows.get(row)
            new = 0 if matcher is None else int(generated[i]) - matcher.consumed
            if new <= 0:
                continue
            if new <= width:
                tokens = tail[i, width - new:]
            else:
                ids, prompt = sharding.to_host((state.tokens[row], state.prompt_len[row]))
                start = int(prompt) + matcher.consumed
                tokens = np.asarray(ids)[start:start + new]
            matcher.advance(tokens)

    def masks(self, at, proposal, candidates, k: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(the proposal [A, k-1], greedy rows' rebuilt along their grammars (None: plain steps, k = 1), the bitmasks
        [A, k, words] int32 of each row ``at``'s k verified positions along it: all ones for rows without a
        grammar). ``candidates`` [A, k-1, C]: the draft's most probable tokens at each position."""
        out = np.full((len(at), k, self.grammars.words), -1, np.int32)
        live = [i for i, row in enumerate(at) if int(row) in self.rows]
        if not live:
            return proposal, out
        proposal = np.zeros((len(at), 0), np.int64) if proposal is None else np.array(proposal)
        mine, sub = proposal[live], np.full((len(live), k, out.shape[2]), -1, np.int32)
        fill_masks([self.rows[int(at[i])] for i in live], mine, [
            candidates[i] if candidates is not None and int(at[i]) in self.guided else None for i in live], sub)
        out[live], proposal[live] = sub, mine
        return (proposal if k > 1 else None), out
