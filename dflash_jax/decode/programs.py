"""A bounded table of compiled programs: a long-lived process (a server, an RL loop) decoding many shapes keeps at
most ``capacity`` executables, dropping the least recently used."""
from __future__ import annotations

import collections

import jax
import numpy as np

CAPACITY = 32


def signature(*trees) -> tuple:
    """What an executable is specialised to: the trees' structure and every leaf's shape, dtype and sharding (a
    hashable key, built in microseconds: the engine looks one up at every dispatch)."""
    leaves, structure = jax.tree_util.tree_flatten(trees)
    return structure, tuple((np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves)


class Programs:
    """``get(key, build)``: the executable cached under ``key``, or ``build()``'s, kept (LRU, ``capacity`` at most)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._table: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, build):
        if key in self._table:
            self._table.move_to_end(key)
            return self._table[key]
        program = build()
        self._table[key] = program
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)
        return program

    def clear(self) -> None:
        self._table.clear()


PROGRAMS = Programs()  # every decode executable of this process (closed batches and slots alike)
