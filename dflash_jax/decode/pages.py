"""The host side of paged caches: ``PagePool`` hands out pages of one pool to rows (a block table per row) and
takes them back, so that a page is always either free or owned by exactly one row. Page ids index every paged
layer's pool at once, the target's and the draft's (one allocation holds a token's K/V in every layer)."""
from __future__ import annotations

import numpy as np

from dflash_jax.state import NO_PAGE


class PagePool:
    """``pages`` pages of ``page`` tokens for ``rows`` rows of at most ``columns`` pages each. ``table`` [rows,
    columns]: the pages each row owns in position order; ``NO_PAGE`` after them."""

    def __init__(self, pages: int, page: int, rows: int, columns: int):
        if pages < 1 or page < 1:
            raise ValueError(f"a page pool needs pages >= 1 and page >= 1, got {pages} pages of {page}")
        self.pages, self.page, self.columns = int(pages), int(page), int(columns)
        self.free = list(range(self.pages - 1, -1, -1))  # pop() hands out the lowest ids first
        self.table = np.full((rows, self.columns), NO_PAGE, np.int32)
        self.owned = np.zeros((rows,), np.int32)  # pages each row holds (its first table entries)
        self.version = 0  # counts the changes of ``table``

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions (0..tokens-1)."""
        return -(-int(tokens) // self.page)

    def capacity(self, row: int) -> int:
        """Positions row ``row``'s pages hold."""
        return int(self.owned[row]) * self.page

    def missing(self, row: int, tokens: int) -> int:
        """Pages row ``row`` lacks to hold ``tokens`` positions."""
        return max(min(self.pages_for(tokens), self.columns) - int(self.owned[row]), 0)

    def grow(self, row: int, tokens: int) -> bool:
        """Give row ``row`` pages for positions 0..tokens-1 (at most its table's) -> False, changing nothing, when
        the pool has too few free pages."""
        need = self.missing(row, tokens)
        if need > len(self.free):
            return False
        have = int(self.owned[row])
        for j in range(have, have + need):
            self.table[row, j] = self.free.pop()
        self.owned[row] = have + need
        self.version += need > 0
        return True

    def release(self, row: int) -> None:
        """Every page of row ``row`` back to the pool."""
        have = int(self.owned[row])
        self.free.extend(int(p) for p in self.table[row, :have][::-1])
        self.table[row] = NO_PAGE
        self.version += have > 0
        self.owned[row] = 0

    def check(self) -> None:
        """Raise unless every page is free or owned by exactly one row (the allocator's invariant)."""
        owned = [int(p) for r in range(len(self.owned)) for p in self.table[r, :self.owned[r]]]
        if sorted(owned + self.free) != list(range(self.pages)):
            raise AssertionError(f"pages leaked or shared: owned {sorted(owned)}, free {sorted(self.free)}")
        if np.any(self.table[np.arange(self.columns)[None] >= self.owned[:, None]] != NO_PAGE):
            raise AssertionError("a table entry past a row's pages names a page")
