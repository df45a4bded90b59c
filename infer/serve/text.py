"""Incremental detokenization of one request's generated ids, with stop strings: each step's new ids become the
text they add (a character split over steps waits for its last byte), and text that may still grow into a stop
string is held back until it cannot (so a streamed answer never shows a stop string it later cuts). The answer's
tokens end at the one that completed the stop string: the ids pushed past it are not part of the answer (nor of
its usage or logprobs)."""
from __future__ import annotations

from typing import Sequence

INCOMPLETE = "\ufffd"  # what a byte-level decoder gives for a character whose bytes have not all arrived


class TextStream:
    """``push(ids)`` -> (new text to send, stopped at a stop string); ``finish()`` -> the text still held back.
    ``text`` is the answer so far (cut before the first stop string, or after it with ``include_stop``); ``ids``
    every id pushed; ``answer_ids`` the ids the answer holds (those up to the one that completed a stop string).
    ``skip_special``: special tokens left out of the text (vLLM's ``skip_special_tokens``, default true)."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), *, skip_special: bool = True, include_stop: bool = False):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.skip_special, self.include_stop = skip_special, include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.kept: int | None = None  # stopped at a stop string: how many ids the answer holds
        self._prefix = self._read = 0  # ids[prefix:read] decoded already: its text is the context of the next
        self._sent = 0

    @property
    def answer_ids(self) -> list[int]:
        return self.ids if self.kept is None else self.ids[:self.kept]

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def _grow(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith(INCOMPLETE)):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _cut(self, start: int, before: int) -> None:
        """Cut the text at the first stop string found from ``start``; ``before``: the ids pushed before this
        call (the token that completed the stop string is one of the rest)."""
        hits = sorted((k, k + len(s)) for k, s in ((self.text.find(s, start), s) for s in self.stops) if k >= 0)
        if hits:
            at, end = hits[0]
            self.text, self.stopped = self.text[:end if self.include_stop else at], True
            lo, hi = before + 1, len(self.ids)  # the fewest ids whose text reaches the stop string's end
            while lo < hi:
                m = (lo + hi) // 2
                if len(self._decode(self.ids[:m]).rstrip(INCOMPLETE)) >= end:
                    hi = m
                else:
                    lo = m + 1
            self.kept = lo

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped or not len(ids):
            return "", self.stopped
        start = max(len(self.text) - self.hold, 0)  # a stop string may begin in text already seen
        before = len(self.ids)
        self.ids += [int(t) for t in ids]
        self._grow(final=False)
        self._cut(start, before)
        upto = len(self.text) if self.stopped else max(len(self.text) - self.hold, self._sent)
        out, self._sent = self.text[self._sent:upto], upto
        return out, self.stopped

    def finish(self) -> str:
        """The end of the answer (what was held back, and a last incomplete character)."""
        if not self.stopped:
            start = max(len(self.text) - self.hold, 0)
            self._grow(final=True)
            self._cut(start, 0)
        out, self._sent = self.text[self._sent:], len(self.text)
        return out
