"""Structured outputs (issue 55): a request's grammar (JSON schema, regex, GBNF, choice) constrains speculative
decoding exactly: greedy, the output equals plain constrained decoding (the same engine without a draft) token for
token, and every output matches its grammar; rows with and without a grammar share steps; a grammar that does not
compile, or an engine that cannot follow one, is refused naming the request. The sampled law is
tests/test_sampling.py's (``test_constrained_law_is_the_masked_targets``).

The trained pair's 64 ids are read as characters (``pairs.CharTokenizer``: 62 characters, then end-of-sequence 62
and the mask token 63), so the grammars apply to a model that never saw them: the draft's proposals often break the
grammar (cut by the mask) and sometimes follow it (accepted), which is what exactness must survive."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from dflash_jax import decode
from dflash_jax.decode import Request
from dflash_jax.decode.slots import LOOKAHEAD_STEPS, PROGRESS_STEPS
from dflash_jax.grammar import Grammar
from pairs import Alternate, CharTokenizer, backend_compiles

CHARS = ' ",:{}[]-.' + "0123456789" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOP"
EOS = 62
TOKENIZER = CharTokenizer(CHARS, 64, EOS)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "point"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc", "DEF"]}, "maxItems": 3},
                         "point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                   "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "y": {"enum": [1, 2, 3]}}}}}
REGEX = r"[a-f]{2,5}-[0-9]{1,3}"
GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]+ | [0-9]'
CHOICES = ["alpha", "beta", "gamma3"]
BROAD = r"[^A-F]{10,60}"  # what the model writes anyway, mostly: its drafts are often accepted


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    pattern = {"regex": REGEX, "broad": BROAD, "gbnf": r"\[([a-c]+|[0-9])(,([a-c]+|[0-9]))*\]"}.get(kind)
    return re.fullmatch(pattern, text) is not None if pattern else text in CHOICES


GRAMMARS = {"json_schema": Grammar.json_schema(SCHEMA), "regex": Grammar.regex(REGEX), "gbnf": Grammar.gbnf(GBNF),
            "choice": Grammar.choice(CHOICES), "broad": Grammar.regex(BROAD)}


def test_greedy_constrained_speculation_is_plain_constrained_decoding(trained):
    """Five grammars, two rows each (one stops at end-of-sequence, one runs to its budget: after the grammar's end
    only end-of-sequence tokens), beside two unconstrained rows in the same batch of slots."""
    target, draft, prompts = trained
    requests = [Request(prompts[i % 5], max_new_tokens=90, grammar=g, stop_token_ids=[EOS] if i % 2 else [])
                for i, g in enumerate(g for g in GRAMMARS.values() for _ in range(2))]
    requests += [Request(prompts[6], max_new_tokens=30), Request(prompts[7], max_new_tokens=30)]
    kw = dict(max_batch=4, tokenizer=TOKENIZER, warm=False, stop_token_ids=[])
    fast = decode.continuous_generate(target, draft, requests, **kw)
    plain = decode.continuous_generate(target, None, requests, **kw)
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert a.output_ids == b.output_ids, i
    kinds = [k for k in GRAMMARS for _ in range(2)]
    for i, (kind, r) in enumerate(zip(kinds, fast)):
        text = TOKENIZER.decode(r.generated_ids)
        assert r.finish_reason == ("stop" if i % 2 else "length"), i
        assert all(t == EOS for t in r.generated_ids[len(text):]) and len(text) < r.num_generated, i
        assert _valid(kind, text), (kind, text)
    free = [fast[-2], fast[-1]]  # unconstrained rows of the same steps: as decoded alone
    alone = decode.speculative_generate(target, draft, [prompts[6], prompts[7]], max_new_tokens=30, stop_token_ids=[])
    assert [r.output_ids for r in free] == [r.output_ids for r in alone]
    assert any(a > 1 for r in fast[:-2] for a in r.acceptance_lengths)  # drafts were accepted under the grammars


def test_constrained_engines_agree(trained):
    """The broad regex (drafts accepted often; no stop: after the grammar's end, end-of-sequence tokens to the
    budget) through the slots engine (page=0), and through a pool too small for the load (rows preempted, their
    matchers rebuilt from their committed tokens) with a block policy alternating plain steps and block 4: the same
    output as the paged engine's, every answer valid."""
    from pairs import tight_pool

    target, draft, prompts = trained
    requests = [Request(p, max_new_tokens=44, grammar=GRAMMARS["broad"], stop_token_ids=[]) for p in prompts[:3]]
    kw = dict(max_batch=3, tokenizer=TOKENIZER, warm=False)
    paged = decode.continuous_generate(target, draft, requests, **kw)
    stats = decode.RunStats()
    others = [decode.continuous_generate(target, draft, requests, page=0, **kw),
              decode.continuous_generate(target, draft, requests, stats=stats, block_policy=Alternate(), **kw,
                                         kv_cache_memory=tight_pool(target, draft, requests, 3))]
    assert stats.preemptions >= 1
    for other in others:
        assert [r.output_ids for r in other] == [r.output_ids for r in paged]
    assert all(_valid("broad", TOKENIZER.decode(r.generated_ids)) for r in paged)


def test_a_warmed_engine_compiles_nothing_for_a_first_constrained_request(trained):
    """``warm(grammars=True)`` (a server's start-up): a request with a grammar, admitted, stepped at every block a
    policy may choose (plain steps, 4, the draft's block) alone (then a run of several constrained steps) and then
    beside a second running row (the next bucket of live rows: every step of it is a constrained one), read and
    released, compiles nothing (jax.monitoring's backend-compile events): a server's first structured requests do
    not wait for the compiler."""
    from dflash_jax.decode import load_policy

    target, draft, prompts = trained
    engine = decode.Engine(target, draft, decode.DecodeOptions(max_new_tokens=40, stop_token_ids=()), max_batch=2,
                           max_length=200, block_policy=Alternate(), tokenizer=TOKENIZER)
    engine.warm([len(prompts[0]), len(prompts[1])], streaming=True, grammars=True)
    blocks = load_policy.candidates(engine.spec.block_size)
    with backend_compiles() as compiles:
        request = Request(prompts[0], max_new_tokens=80, grammar=GRAMMARS["broad"], stop_token_ids=[])
        state, rows = engine.admit(engine.empty(), [request])
        for k in blocks:
            state, taken = engine.run(state, 1, block=k)
            assert taken == 1
        # a longer run goes on step after step (no row finishes in it) for the steps its row has pages for
        state, taken = engine.run(state, PROGRESS_STEPS, block=1)
        assert taken == LOOKAHEAD_STEPS
        state, more = engine.admit(state, [Request(prompts[1], max_new_tokens=40, stop_token_ids=[])])
        for k in blocks:
            state, taken = engine.run(state, 1, block=k)
            assert taken == 1 and not engine.finished_rows(state)  # both rows ran: the bucket of two
        engine.progress(state, 1)
        engine.release(state, rows + more)
    assert compiles == []


def test_grammar_refusals(trained):
    target, draft, prompts = trained
    for bad, msg in ((Grammar.json_schema('{"type": "object"'), "not a JSON object"),
                     (Grammar.json_schema({"type": "nothing"}), "does not compile"),
                     (Grammar.regex("[a-"), "does not|not parse"),
                     (Grammar.gbnf("root ::= missing_rule"), "does not|not parse")):
        with pytest.raises(ValueError, match=f"request 1: .*({msg})"):
            decode.continuous_generate(target, draft, [Request(prompts[0], max_new_tokens=4),
                                                       Request(prompts[1], max_new_tokens=4, grammar=bad)],
                                       max_batch=2, tokenizer=TOKENIZER, warm=False)
    ok = Request(prompts[0], max_new_tokens=4, grammar=GRAMMARS["regex"])
    with pytest.raises(ValueError, match="needs an engine built with its tokenizer"):
        decode.continuous_generate(target, draft, [ok], max_batch=1, warm=False)
    with pytest.raises(ValueError, match="tree_budget=0"):
        decode.continuous_generate(target, draft, [ok], max_batch=1, tokenizer=TOKENIZER, tree_budget=6, warm=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        Grammar("xml", "<a/>")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        Grammar.choice([])


def test_another_family_llama():
    """A LLaMA target (16 ids: 14 characters, end-of-sequence, mask; a peaked head, so that a random block-4 draft is
    sometimes right): greedy constrained speculation equals plain constrained decoding under a regex."""
    from dflash_jax.target import Target, init_params
    from pairs import random_draft, tiny_target_config

    tcfg = tiny_target_config(16, layers=2, model_type="llama", qk_norm=False, eos_token_id=(14,))
    params = init_params(tcfg, 0)
    target = Target(tcfg, dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 8}))
    draft = random_draft(tcfg, block_size=4, seed=1, draft_layers=1, target_layer_ids=(0, 1))
    tok = CharTokenizer("abcdef012345{}", 16, 14)
    regex = r"[a-f]{1,6}[0-5]{1,4}"
    requests = [Request(p, max_new_tokens=16, grammar=Grammar.regex(regex), stop_token_ids=[14])
                for p in ([1, 5, 3], [2, 7, 7, 1], [9, 0], [4, 4, 4, 12, 3])]
    kw = dict(max_batch=4, tokenizer=tok, warm=False)
    fast = decode.continuous_generate(target, draft, requests, **kw)
    plain = decode.continuous_generate(target, None, requests, **kw)
    assert [r.output_ids for r in fast] == [r.output_ids for r in plain]
    assert all(re.fullmatch(regex, tok.decode(r.generated_ids)) for r in fast)
    assert any(a > 1 for r in fast for a in r.acceptance_lengths)


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
def test_ring_and_recurrent_caches_under_a_grammar(kind):
    """Sliding-window rings and Qwen3.5's recurrent stashes under a regex: plain constrained steps (the target's
    forward dispatched before the host's masks, left uncommitted where a run ends: the next forward overwrites it)
    give the draft's constrained block-4 steps' answers, and so does a policy alternating the two (a block-4 verify
    right after an uncommitted plain forward); every answer matches the regex."""
    from test_continuous import kind_pair

    target, draft = kind_pair(kind)
    tok = CharTokenizer("abcdef0123456789", 32, 16)
    regex = r"[a-f]{2,9}[0-9]{1,6}"
    requests = [Request(p, max_new_tokens=20, grammar=Grammar.regex(regex), stop_token_ids=[])
                for p in ([1, 5, 3], [2, 7, 7, 1, 9], [9, 0])]
    kw = dict(max_batch=2, tokenizer=tok, warm=False)
    plain = decode.continuous_generate(target, None, requests, **kw)
    block4 = decode.continuous_generate(target, draft, requests, **kw)
    both = decode.continuous_generate(target, draft, requests, block_policy=Alternate(), **kw)
    assert [r.output_ids for r in block4] == [r.output_ids for r in plain]
    assert [r.output_ids for r in both] == [r.output_ids for r in plain]
    assert all(re.fullmatch(regex, tok.decode(r.generated_ids)) for r in plain)
