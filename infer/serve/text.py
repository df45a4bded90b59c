"""Incremental detokenization of one request's generated ids, with stop strings: each step's new ids become the
text they add (a character split over steps waits for its last byte), and text that may still grow into a stop
string is held back until it cannot (so a streamed answer never shows a stop string it later cuts)."""
from __future__ import annotations

from typing import Sequence

INCOMPLETE = "\ufffd"  # what a byte-level decoder gives for a character whose bytes have not all arrived


class TextStream:
    """``push(ids)`` -> (new text to send, stopped at a stop string); ``finish()`` -> the text still held back.
    ``text`` is the answer so far (cut before the first stop string); ``ids`` every id pushed."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = self._read = 0  # ids[prefix:read] decoded already: its text is the context of the next
        self._sent = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _grow(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith(INCOMPLETE)):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _cut(self, start: int) -> None:
        hits = [k for k in (self.text.find(s, start) for s in self.stops) if k >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped or not len(ids):
            return "", self.stopped
        start = max(len(self.text) - self.hold, 0)  # a stop string may begin in text already seen
        self.ids += [int(t) for t in ids]
        self._grow(final=False)
        self._cut(start)
        upto = len(self.text) if self.stopped else max(len(self.text) - self.hold, self._sent)
        out, self._sent = self.text[self._sent:upto], upto
        return out, self.stopped

    def finish(self) -> str:
        """The end of the answer (what was held back, and a last incomplete character)."""
        if not self.stopped:
            start = max(len(self.text) - self.hold, 0)
            self._grow(final=True)
            self._cut(start)
        out, self._sent = self.text[self._sent:], len(self.text)
        return out
