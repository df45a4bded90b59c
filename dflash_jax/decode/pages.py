"""The host side of paged caches: ``PagePool`` hands out pages of one pool to rows (a block table per row) and
takes them back. Page ids index every paged layer's pool at once, the target's and the draft's (one allocation
holds a token's K/V in every layer).

Prefix caching: a full page of prompt tokens is named by a hash chain over the tokens up to its end; rows whose
prompts start with the same tokens share those pages read-only (reference-counted; a row only ever writes past its
prompt's full pages), and a cached page no row holds stays ``idle`` until the pool needs it (least recently used
first). The draft's context K/V of a token depends only on the tokens before it too, so it is shared with the
target's in the same page."""
from __future__ import annotations

import collections

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
        self.refs = np.zeros((self.pages,), np.int32)  # rows holding each page
        self.page_of: dict[int, int] = {}  # prefix hash -> its cached page
        self.hash_of: dict[int, int] = {}  # cached page -> its prefix hash
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by no row: LRU first
        self.evictions = 0

    def available(self) -> int:
        """Pages a row may be given: the free ones, and the idle cached ones (evicted when taken)."""
        return len(self.free) + len(self.idle)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        page, _ = self.idle.popitem(last=False)  # the least recently used cached page
        del self.page_of[self.hash_of.pop(page)]
        self.evictions += 1
        return page

    @staticmethod
    def chain(tokens, page: int, pages: int) -> list[int]:
        """The hashes naming the first ``pages`` full pages of ``tokens``: each covers every token up to its end."""
        out, h = [], 0
        for i in range(pages):
            h = hash((h, tuple(int(t) for t in tokens[i * page:(i + 1) * page])))
            out.append(h)
        return out

    def lookup(self, hashes) -> list[int]:
        """The cached pages of the longest run of ``hashes`` from the first."""
        out = []
        for h in hashes:
            if h not in self.page_of:
                break
            out.append(self.page_of[h])
        return out

    def pinned(self, pages) -> int:
        """How many of ``pages`` (cached) no row holds now: sharing them takes them off the idle list."""
        return sum(1 for p in set(pages) if p in self.idle)

    def share(self, row: int, pages) -> None:
        """Row ``row``'s next pages are the cached ``pages`` (read-only: its writes go past them); the row holds
        only shared pages so far."""
        have = int(self.owned[row])
        for j, p in enumerate(pages, have):
            self.table[row, j] = p
            self.refs[p] += 1
            self.idle.pop(p, None)
        self.owned[row] = have + len(pages)
        self.version += len(pages) > 0

    def drop_cached(self) -> None:
        """Forget every cached page (new weights: their K/V is stale; a new state: its pools do not hold them); none
        may be held by a row."""
        if any(self.refs[p] for p in self.hash_of):
            raise ValueError("cached pages are held by rows: release them first")
        self.free.extend(self.idle)
        self.idle.clear()
        self.page_of.clear()
        self.hash_of.clear()

    def register(self, row: int, hashes) -> None:
        """Row ``row``'s first pages, full of the prompt tokens ``hashes`` name, become cached (a hash already
        cached keeps its page)."""
        for j, h in enumerate(hashes):
            p = int(self.table[row, j])
            if h not in self.page_of and p not in self.hash_of:
                self.page_of[h], self.hash_of[p] = p, h

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
        if need > self.available():
            return False
        have = int(self.owned[row])
        for j in range(have, have + need):
            self.table[row, j] = p = self._take()
            self.refs[p] = 1
        self.owned[row] = have + need
        self.version += need > 0
        return True

    def release(self, row: int) -> None:
        """Every page of row ``row`` back to the pool (a cached one no other row holds: idle, most recent)."""
        have = int(self.owned[row])
        for p in (int(p) for p in self.table[row, :have][::-1]):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.hash_of:
                    self.idle[p] = None
                else:
                    self.free.append(p)
        self.table[row] = NO_PAGE
        self.version += have > 0
        self.owned[row] = 0

    def check(self) -> None:
        """Raise unless every page is free, idle (cached, no row holds it) or held by the rows that name it, and the
        cache's maps agree (the allocator's invariant)."""
        held = collections.Counter(int(p) for r in range(len(self.owned)) for p in self.table[r, :self.owned[r]])
        if any(self.refs[p] != held[p] for p in range(self.pages)):
            raise AssertionError(f"reference counts {self.refs.tolist()} != the rows holding each page {dict(held)}")
        unheld = sorted(self.free + list(self.idle))
        if unheld != [p for p in range(self.pages) if not held[p]]:
            raise AssertionError(f"pages leaked or doubly free: free {sorted(self.free)}, idle {list(self.idle)}")
        if any(p not in self.hash_of for p in self.idle) or any(p in self.hash_of for p in self.free):
            raise AssertionError("an idle page not cached, or a free page still cached")
        if {p: h for h, p in self.page_of.items()} != self.hash_of:
            raise AssertionError("the prefix cache's two maps disagree")
        if np.any(self.table[np.arange(self.columns)[None] >= self.owned[:, None]] != NO_PAGE):
            raise AssertionError("a table entry past a row's pages names a page")
