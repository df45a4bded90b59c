"""Structured outputs, the host side: a request's ``Grammar`` (a JSON schema, any JSON object, a regex, a Lark or
GBNF grammar) compiled by llguidance (the ``grammar`` extra) into a token matcher per row, which gives the token
bitmask at each position of a step's proposal and follows what the step commits (``decode.constrained``).

llguidance, not xgrammar: it installs from PyPI with no dependencies (xgrammar pulls torch), computes one mask in
tens of microseconds with no ahead-of-time compilation of the vocabulary, and rolls back consumed tokens (what
masks along a proposal need)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")
# JSON answers: at most one space where JSON allows whitespace (compact and json.dumps-style answers both match), no
# newlines: a model cannot run out its budget on whitespace. A schema's "x-guidance" key overrides it.
JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an optional extra
        raise ImportError("structured outputs need llguidance: pip install -e '.[grammar]'") from e
    return llguidance


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` one of ``KINDS`` and its ``source`` (the schema as JSON text,
    the regex, the grammar text, the choices as a JSON list of strings; json_object: none). Hashable: compiled
    matchers are cached per grammar."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a grammar's kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"a {self.kind} grammar's source must be a string, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> "Grammar":
        """A llama.cpp / vLLM style EBNF grammar (``root ::= ...``)."""
        return cls("gbnf", text)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        """Exactly one of the strings ``options`` (vLLM's guided_choice)."""
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError(f"a choice needs a non-empty list of strings, got {options!r}")
        return cls("choice", json.dumps(list(options)))

    def llguidance(self) -> str:
        """The grammar in llguidance's own form (ValueError: a source that does not parse)."""
        if self.kind in ("json_object", "json_schema"):
            try:
                schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
                return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:  # json.JSONDecodeError is one
                raise ValueError(f"the JSON schema is not a JSON object: {e}") from e
        try:
            return _llguidance().grammar_from(self.kind, self.source)
        except Exception as e:  # noqa: BLE001 (llguidance's converters raise their own types)
            raise ValueError(f"the {self.kind} grammar does not parse: {e}") from e


class Grammars:
    """One engine's grammar compiler: llguidance's view of the tokenizer (built once: about a second for a large
    vocabulary) and one compiled matcher per grammar (cached; every row matches on a copy of it).

    ``tokenizer``: a Hugging Face fast tokenizer, or any object with ``tokens`` (each id's bytes), ``eos_token_id``,
    ``bos_token_id`` and a call from text to ids (llguidance's ``TokenizerWrapper``). ``vocab_size``: the model's
    (ids past the tokenizer's are never allowed). ``eos_ids``: the ids that end a row (default: the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int] | None = None):
        llg = _llguidance()
        eos = list(eos_ids) if eos_ids else None
        if hasattr(tokenizer, "backend_tokenizer"):
            import llguidance.hf

            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        elif hasattr(tokenizer, "tokens"):
            self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(tokenizer), n_vocab=vocab_size, eos_token=eos)
        else:
            raise ValueError("structured outputs need a tokenizer: a Hugging Face fast tokenizer, or an object "
                             f"with tokens / eos_token_id (llguidance's TokenizerWrapper); got {type(tokenizer)}")
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32  # int32 words of one bitmask
        self._compiled: dict[Grammar, Any] = {}
        self.executor = llg.LLExecutor()  # fills many rows' masks in parallel (threads: 80% of the CPUs)

    def compile(self, grammar: Grammar):
        """``grammar``'s matcher in its initial state (cached), or ValueError naming what does not compile."""
        if not isinstance(grammar, Grammar):
            raise ValueError(f"expected a dflash_jax.grammar.Grammar, got {type(grammar).__name__}")
        found = self._compiled.get(grammar)
        if found is None:
            llg = _llguidance()
            matcher = llg.LLMatcher(self.tokenizer, grammar.llguidance(), log_level=0)
            if matcher.is_error():
                raise ValueError(f"the {grammar.kind} grammar does not compile: {matcher.get_error()}")
            found = self._compiled[grammar] = matcher
        return found

    def matcher(self, grammar: Grammar) -> "RowMatcher":
        """A fresh matcher of ``grammar`` for one row."""
        return RowMatcher(self.compile(grammar).deep_copy(), self.words, self.tokenizer.eos_tokens, self.executor)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether the bitmask ``mask`` [words] int32 allows ``token``."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class RowMatcher:
    """One row's grammar state: its committed tokens consumed (``consumed`` of them). After an end-of-sequence token
    (allowed where the grammar is complete) only end-of-sequence tokens follow: a row that does not stop on it
    keeps to the grammar."""

    def __init__(self, matcher, words: int, eos_ids: Sequence[int], executor):
        self._m, self.words, self.consumed, self.ended, self.executor = matcher, words, 0, False, executor
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.eos_mask = np.zeros(words, np.int32)
        for e in self.eos_ids:
            self.eos_mask[e // 32] |= np.int32(np.uint32(1 << (e % 32)).view(np.int32))

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed ``tokens`` (allowed by construction: RuntimeError if the grammar refuses one)."""
        for t in (int(t) for t in tokens):
            self.ended = self.ended or t in self.eos_ids
            if not self.ended and not self._m.is_stopped() and not self._m.consume_token(t):
                raise RuntimeError(f"the grammar refused a committed token {t}: {self._m.get_error()}")
        self.consumed += len(tokens)

    def first_mask(self) -> np.ndarray:
        """The bitmask [words] of the next token."""
        out = np.full((1, 1, self.words), -1, np.int32)
        fill_masks([self], np.zeros((1, 0), np.int64), [None], out)
        return out[0, 0]

    def forced(self, mask: np.ndarray, ended: bool) -> int | None:
        """The token the grammar forces next, if it forces one: the first of its fast-forward tokens (the canonical
        tokenization of the bytes it forces: a JSON schema's keys and punctuation), or the one token ``mask``
        allows."""
        ff = [] if ended or self._m.is_stopped() else self._m.compute_ff_tokens()
        if ff and allows(mask, ff[0]):
            return int(ff[0])
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return int(np.flatnonzero(bits)[0]) if np.count_nonzero(bits) == 1 else None


def fill_masks(matchers: Sequence[RowMatcher], proposals: np.ndarray, candidates, out: np.ndarray) -> None:
    """``out`` [R, K, words] int32 (C-contiguous, all ones on entry), row r position i: the bitmask of the token
    after row r's committed tokens and ``proposals``[r, :i] ([R, K-1]), each position's masks of every row filled at
    once by llguidance's executor (in parallel), the matchers advanced along the proposals and rolled back after.
    Past a proposal's first token that its position forbids, all ones: the masked target rejects that token, so
    nothing after it is committed. A row with ``candidates``[r] ([K-1, C]: the draft's most probable tokens at each
    position, best first; a greedy row's) has its proposal rebuilt in place to follow the grammar: each token the
    one the grammar forces (``RowMatcher.forced``), else the best allowed candidate, else the draft's own (forbidden:
    the proposal ends). Greedy verification is exact for any proposal."""
    rows, k = out.shape[:2]
    flat = out.reshape(rows * k, out.shape[2])
    consumed, ended, active = [0] * rows, [m.ended for m in matchers], list(range(rows))
    for i in range(k):
        done = [r for r in active if ended[r] or matchers[r]._m.is_stopped()]
        par = [(matchers[r]._m, r * k + i) for r in active if r not in done]
        if par:
            matchers[0].executor.unsafe_compute_mask_ptr(par, flat.ctypes.data, flat.shape[1] * 4, rows * k)
        for r in done:
            out[r, i] = matchers[r].eos_mask
        if i == k - 1:
            break
        still = []
        for r in active:
            m, mask = matchers[r], out[r, i]
            if candidates[r] is not None:
                found = m.forced(mask, ended[r])
                if found is None:
                    found = next((int(c) for c in candidates[r][i] if allows(mask, int(c))), None)
                if found is not None:
                    proposals[r, i] = found
            d = int(proposals[r, i])
            if not allows(mask, d):
                continue
            if d in m.eos_ids or ended[r] or m._m.is_stopped():
                ended[r] = True
            else:
                m._m.consume_token(d)
                consumed[r] += 1
            still.append(r)
        active = still
    for m, n in zip(matchers, consumed):
        if n:
            m._m.rollback(n)
