"""Guards on the server's promises that its texts alone do not show (issue #57), on a tiny random pair (vocabulary
8, so that a random draft is sometimes right and samples vary) served in this process over real HTTP, token ids in
and out (no tokenizer). Each test states a property and was seen to fail with a plausible bug put in by hand (named
in its docstring):

- an answer that ends on the EOS id has ``finish_reason`` "stop", whole and streamed;
- two requests without a seed draw from different key streams (same prompt: different tokens);
- ``/metrics``' acceptance histogram counts exactly the ``acceptance_lengths`` the responses carry (its sum and count);
- a request cancelled while it waits in the queue is never admitted (no prefill is spent on it)."""
from __future__ import annotations

import dataclasses
import queue
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions
from dflash_jax.target import Target
from infer.serve.launch import Running
from infer.serve.protocol import CompletionRequest
from infer.serve.service import Limits, Service
from pairs import random_pair

MODEL, SLOTS, MAX_LENGTH = "tiny", 2, 64
PROMPTS = [[6, 2, 5], [6, 2, 4, 4, 3, 5, 2, 6, 3], [2, 6, 5, 3, 3]]


@pytest.fixture(scope="module")
def pair():
    """(target whose EOS id is a token its greedy answer to PROMPTS[0] reaches after a few tokens, draft, that
    answer up to and with the EOS id)."""
    target, draft = random_pair(vocab=8, block_size=4)
    free = decode.generate(target, [PROMPTS[0]], max_new_tokens=16, stop_token_ids=[])[0].generated_ids
    at = next(i for i in range(3, 10) if free[i] not in free[:i])
    eos = free[at]
    target = Target(dataclasses.replace(target.config, eos_token_id=(eos,)), target.params)
    return target, draft, free[:at + 1]


@pytest.fixture(scope="module")
def served(pair):
    target, draft, _ = pair
    options = DecodeOptions(max_new_tokens=16, stop_token_ids=target.config.eos_token_id)
    service = Service(target, draft, None, options, Limits(SLOTS, MAX_LENGTH, 16), name=MODEL)
    with Running(service, warm=False) as running:
        yield service, running.url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1], api_key="none", max_retries=0, timeout=300)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_an_eos_answer_finishes_with_stop(pair, client):
    """A greedy answer that reaches the EOS id inside its budget: ``finish_reason`` "stop" (whole, and on the
    streamed last chunk), its ids the plain decoding's up to the EOS; cut by its budget instead: "length". Bug
    caught: the server reporting a stop-token finish as "length"."""
    _, _, want = pair
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "stop"
    assert _ids(whole.choices[0])[:len(want) - 1] == want[:-1] and len(_ids(whole.choices[0])) < 12
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    short = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=len(want) - 1, temperature=0)
    assert short.choices[0].finish_reason == "length"


def test_unseeded_requests_draw_from_different_streams(client):
    """The same prompt sampled twice without a seed: different tokens (each request its own key stream); with one
    seed: the same tokens. Bug caught: every unseeded request given the same stream."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a, b = (_ids(client.completions.create(**kw).choices[0]) for _ in range(2))
    assert len(a) == len(b) == 16 and a != b
    s1, s2 = (_ids(client.completions.create(seed=5, **kw).choices[0]) for _ in range(2))
    assert s1 == s2


def _acceptance(url) -> tuple[float, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name in ("dflash_acceptance_length_sum", "dflash_acceptance_length_count")}
    return got["dflash_acceptance_length_sum"], got["dflash_acceptance_length_count"]


def test_metrics_count_the_acceptance_lengths_the_responses_carry(pair, served, client):
    """Requests of every kind at once (sampled, greedy, one whose first token is the EOS id: it finishes at its
    prefill and never steps, beside a row that does; budgets of 1): the acceptance histogram's sum and count grow by
    exactly the sum and number of the ``acceptance_lengths`` the responses carry. Bugs caught: counting each row's
    previous step instead of its last; counting a row that did not step."""
    _, url = served
    _, _, want = pair
    before = _acceptance(url)
    at_eos = PROMPTS[0] + want[:-1]  # greedy: its first token is the EOS id
    bodies = [dict(prompt=[at_eos, PROMPTS[2]], max_tokens=10, temperature=0),
              dict(prompt=PROMPTS[1], max_tokens=14, temperature=1.0, seed=3, extra_body={"ignore_eos": True}),
              dict(prompt=PROMPTS[2], max_tokens=1, temperature=1.0, seed=4),
              dict(prompt=PROMPTS[0], max_tokens=9, temperature=0.7, seed=6, extra_body={"ignore_eos": True}),
              dict(prompt=[at_eos, PROMPTS[1]], max_tokens=6, temperature=1.0, seed=8)]
    answers: list = [None] * len(bodies)

    def ask(i):
        answers[i] = client.completions.create(model=MODEL, **bodies[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    lengths = [a for r in answers for c in r.choices for a in c.model_extra["acceptance_lengths"]]
    first = sorted(answers[0].choices, key=lambda c: c.index)
    assert first[0].model_extra["acceptance_lengths"] == [] and first[0].finish_reason == "stop"  # never stepped
    assert len(set(lengths)) > 1  # acceptance varies: a count of the wrong step would show
    after = _acceptance(url)
    assert (after[0] - before[0], after[1] - before[1]) == (sum(lengths), len(lengths))


def test_a_request_cancelled_in_the_queue_is_never_admitted(served):
    """Both slots busy with long answers, a third request queued behind them and cancelled there: it finishes as
    "cancelled" and never reaches the engine (no admission, no prefill), the other two answer in full. Bug caught:
    the scheduler admitting a queued request whose client already left."""
    service, _ = served
    admitted, events = [], queue.Queue()
    engine_admit = service.engine.admit

    def admit(state, requests, rows=None):
        admitted.extend(requests)
        return engine_admit(state, requests, rows)

    service.engine.admit = admit  # the instance's own attribute: the scheduler calls this
    try:
        body = CompletionRequest(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, ignore_eos=True)
        jobs = [service.jobs(body, [PROMPTS[k]], 40, lambda e, k=k: events.put((k, e)))[0] for k in range(3)]
        service.submit(jobs)
        jobs[2].cancel()  # the two slots hold jobs 0 and 1 for 40 tokens each: job 2 is still in the queue
        done = {}
        while len(done) < 3:
            k, event = events.get(timeout=300)
            if type(event).__name__ in ("Done", "Failed"):
                done[k] = event
    finally:
        del service.engine.admit
    assert done[2].finish_reason == "cancelled"
    assert [done[k].finish_reason for k in (0, 1)] == ["length", "length"] and len(done[0].ids) == 40
    assert not any(r is jobs[2].request for r in admitted)
    assert any(r is jobs[0].request for r in admitted) and any(r is jobs[1].request for r in admitted)


def test_block_size_auto_measures_at_start_and_serves_plain_decodings_tokens(pair):
    """A server with the load-following block (``--block-size auto``'s ``Limits.block_policy``): its warm-up
    measures a step cost for every bucket of live rows and block (1 = plain steps, and the draft's 4), /metrics
    gives the block of every bucket, and greedy answers at any concurrency equal plain decoding. Bug caught: the
    probes' dummy rows taught to the acceptance estimate (their steps are counted before any request)."""
    target, draft, _ = pair
    options = DecodeOptions(max_new_tokens=16, stop_token_ids=[])
    service = Service(target, draft, None, options, Limits(SLOTS, MAX_LENGTH, 16, block_policy="auto"), name=MODEL)
    with Running(service, warm=True) as running:
        policy = service.engine.block_policy
        assert set(policy.step_s) == {(b, k) for b in (1, 2) for k in (1, 4)} and policy.acceptance.steps == 0
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=300)
        both = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0)
        want = decode.generate(target, PROMPTS[:2], max_new_tokens=12, stop_token_ids=[])
        assert [_ids(c) for c in sorted(both.choices, key=lambda c: c.index)] == [w.generated_ids for w in want]
        families = text_string_to_metric_families(httpx.get(running.url.removesuffix("/v1") + "/metrics").text)
        blocks = {s.labels["bucket"]: s.value for f in families if f.name == "dflash_block_size" for s in f.samples}
    assert set(blocks) == {"1", "2"} and set(blocks.values()) <= {1, 4}
    # the requests' drafted steps were taught, or every step was plain (the table's block for a bucket the requests
    # never ran at, say 1 row, may draft: /metrics shows the table, not what ran)
    assert policy.acceptance.steps > 0 or policy.plain_steps >= 11
