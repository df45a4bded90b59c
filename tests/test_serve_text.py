"""The server's incremental detokenizer (``infer.serve.text.TextStream``) on the demo tokenizer: pushed in any
split, the pieces add up to the whole decode; a character whose bytes span pushes waits for its last byte; a stop
string is cut at its first occurrence and never shown in part, wherever the pushes split it."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from dflash_jax.demo import DEMO_TARGET
from infer.serve.text import TextStream

TEXT = "def área(r):\n    # π r² — the disc's area\n    return 3.14159 * r ** 2\n\n\nprint(área(2))  # ✓\n"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


def pieces(ids, seed):
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_pieces_add_up_to_the_whole_decode(tok, seed):
    ids = tok(TEXT)["input_ids"]
    s = TextStream(tok)
    sent = []
    for p in pieces(ids, seed):
        out, stopped = s.push(p)
        assert not stopped and "\ufffd" not in out  # never half a character
        sent.append(out)
    sent.append(s.finish())
    assert "".join(sent) == tok.decode(ids) == TEXT and s.ids == ids


@pytest.mark.parametrize("seed", range(4))
def test_stop_string_cut_and_never_shown(tok, seed):
    ids = tok(TEXT)["input_ids"]
    stop = "area\n"
    s = TextStream(tok, [stop, "never there"])
    shown = ""
    for p in pieces(ids, seed):
        out, stopped = s.push(p)
        shown += out
        assert TEXT[:TEXT.index(stop)].startswith(shown)  # nothing past the cut is ever shown, not even in part
        if stopped:
            break
    shown += s.finish()
    assert stopped and shown == TEXT[:TEXT.index(stop)] == s.text
    assert s.push(ids[:2]) == ("", True)  # nothing after the stop


def test_earliest_of_several_stops_wins(tok):
    s = TextStream(tok, ["return", "# π"])
    out, stopped = s.push(tok(TEXT)["input_ids"])
    assert stopped and out + s.finish() == TEXT[:TEXT.index("# π")]


@pytest.mark.parametrize("seed", range(3))
def test_answer_ids_end_at_the_token_that_completed_the_stop(tok, seed):
    """The ids past the stop string are not the answer's (nor its usage's): the answer's last id completes it."""
    ids = tok(TEXT)["input_ids"]
    stop = "area\n"
    s = TextStream(tok, [stop])
    for p in pieces(ids, seed):
        if s.push(p)[1]:
            break
    kept = s.answer_ids
    assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])
    assert kept == ids[:len(kept)]


def test_include_stop_string_and_special_tokens(tok):
    ids = tok(TEXT)["input_ids"]
    s = TextStream(tok, ["area\n"], include_stop=True)
    out, stopped = s.push(ids)
    assert stopped and out + s.finish() == TEXT[:TEXT.index("area\n") + len("area\n")]
    special = ids[:3] + [0] + ids[3:6]  # <|endoftext|> in the middle
    kept, shown = TextStream(tok), TextStream(tok, skip_special=False)
    assert "<|endoftext|>" not in kept.push(special)[0] + kept.finish()
    assert "<|endoftext|>" in shown.push(special)[0] + shown.finish()
