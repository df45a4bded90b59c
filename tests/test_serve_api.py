"""The server as OpenAI / vLLM clients use it (issue 51), on the demo pair, one server in this process (uvicorn in a
thread, real HTTP): log-probabilities equal to the target's own log-softmax (completions with echo, lm-eval's
``echo, max_tokens 0 / 1, logprobs 1`` scoring, chat), ``n`` choices with their own key streams, the policy table
of vLLM's fields (honoured / ignored with a warning / refused), usage once (or per chunk), the answer's tokens
ending at a stop string, a lone surrogate a 400, every outcome counted in /metrics, an access line per request,
a body over the limit a 413, a large prompt tokenized off the event loop, a non-streamed request whose client
left cancelled, and the request defaults (temperature from generation_config else 1; max_tokens as vLLM's)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dflash_jax as dj
import infer.serve.app as app_module
from infer.serve.__main__ import build_service, generation_defaults, parse_args, resolve_defaults
from infer.serve.launch import Running

MAX_LENGTH = 512
PROMPT = "def add(a, b):\n"
MODEL = "dflash-demo"


@pytest.fixture(scope="module")
def served():
    service = build_service(parse_args(["--max-batch", "4", "--max-length", str(MAX_LENGTH), "--no-warm",
                                        "--log-level", "warning"]))
    with Running(service, warm=False) as running:
        yield service, running.url[:-len("/v1")]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(served):
    return served[0].tokenizer


def log_softmax(service, ids) -> np.ndarray:
    """[T, V] float64 log-softmax of the target's logits over ids, by dj.target_logits (the reference)."""
    logits = dj.target_logits(service.target, [ids])[0].astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


def plain(service, ids, n, stop=True):
    stops = list(service.target.config.eos_token_id) if stop else []
    return dj.generate(service.target, [ids], max_new_tokens=n, stop_token_ids=stops)[0].generated_ids


def metrics(base) -> dict:
    text = httpx.get(base + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def requests_count(m, endpoint, outcome) -> float:
    return m.get(("dflash_requests_total", (("endpoint", endpoint), ("outcome", outcome))), 0)


# --- log-probabilities ----------------------------------------------------------------------------------------
def test_completion_logprobs_with_echo_equal_the_targets_log_softmax(served, client, tok):
    service = served[0]
    prompt = tok(PROMPT)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    assert out == plain(service, prompt, 12, stop=False)  # lossless: greedy = plain decoding
    assert c.text == PROMPT + tok.decode(out)
    ids = prompt + out
    ref = log_softmax(service, ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
    for t in range(1, len(ids)):
        best = np.argsort(-ref[t - 1])[:3]
        top = lp.top_logprobs[t]
        assert {tok.decode([int(i)]) for i in best} <= set(top)  # the 3 most probable, and the chosen one
        np.testing.assert_allclose(sorted(top.values())[-1], ref[t - 1, best[0]], atol=1e-4)
    for t in range(len(prompt), len(ids)):  # greedy: each generated token is its position's most probable
        assert lp.token_logprobs[t] == max(lp.top_logprobs[t].values())
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_lm_eval_loglikelihood_requests(served, client):
    """lm-eval's ``local-completions`` loglikelihood: token-id prompts, echo, logprobs 1, max_tokens 1 (its last
    token dropped) or 0 (the prompt scored alone)."""
    service = served[0]
    prompts = [[5, 9, 300, 41, 7], [12, 13, 14]]
    for budget in (0, 1):
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=budget, temperature=0, logprobs=1,
                                      echo=True, seed=1234)
        assert [c.index for c in r.choices] == [0, 1]
        for c, ids in zip(r.choices, prompts):
            ref = log_softmax(service, ids)
            got = c.logprobs.token_logprobs[:len(ids)]
            assert got[0] is None
            np.testing.assert_allclose(got[1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)
            assert len(c.logprobs.tokens) == len(ids) + budget
            assert all(len(top) <= 2 for top in c.logprobs.top_logprobs[1:])
        assert r.usage.completion_tokens == budget * len(prompts)


def test_chat_logprobs(served, client, tok):
    service = served[0]
    messages = [{"role": "user", "content": "a stack class"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    prompt = service.chat_prompt(service_request(messages))
    out = r.choices[0].model_extra["token_ids"]
    assert out == plain(service, prompt, 8, stop=False)
    ref = log_softmax(service, prompt + out)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in out]
    np.testing.assert_allclose([c.logprob for c in content],
                               [ref[len(prompt) + i - 1, t] for i, t in enumerate(out)], atol=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def service_request(messages):
    from infer.serve.protocol import ChatRequest

    return ChatRequest(model=MODEL, messages=messages)


# --- n --------------------------------------------------------------------------------------------------------
def test_n_choices_have_their_own_streams_and_are_reproducible(served, client, tok):
    ask = lambda seed: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3,  # noqa
                                                 seed=seed, extra_body={"ignore_eos": True})
    a, b = ask(5), ask(5)
    ids = lambda r: [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]  # noqa
    assert [c.index for c in a.choices] == [0, 1, 2] and ids(a) == ids(b)
    assert len({json.dumps(x) for x in ids(a)}) > 1  # distinct key streams
    assert a.usage.prompt_tokens == 3 * len(tok(PROMPT)["input_ids"]) and a.usage.completion_tokens == 30
    service = served[0]
    prompts = [tok(PROMPT)["input_ids"], tok("import os\n")["input_ids"]]
    g = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    want = [plain(service, p, 8) for p in prompts]
    assert [c.model_extra["token_ids"] for c in g.choices] == [want[0], want[0], want[1], want[1]]  # i * n + j
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                   max_tokens=4, temperature=0, stream=True))
    assert {ch.choices[0].index for ch in streamed} == {0, 1}


# --- vLLM's fields ----------------------------------------------------------------------------------------------
POLICY = [  # (extra fields, endpoint, honoured | ignored | refused)
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "completions",
     "honoured"),
    ({"min_tokens": 4, "ignore_eos": True}, "completions", "honoured"),
    ({"min_tokens": 4}, "completions", "refused"),
    ({"repetition_penalty": 1.0}, "completions", "honoured"),
    ({"repetition_penalty": 1.2}, "completions", "refused"),
    ({"min_p": 0}, "completions", "honoured"),
    ({"min_p": 0.1}, "completions", "refused"),
    ({"presence_penalty": 0.5}, "completions", "refused"),
    ({"frequency_penalty": 0.5}, "chat", "refused"),
    ({"skip_special_tokens": False}, "completions", "honoured"),
    ({"spaces_between_special_tokens": True}, "completions", "honoured"),
    ({"spaces_between_special_tokens": False}, "completions", "refused"),
    ({"include_stop_str_in_output": True, "stop": ["\n"]}, "completions", "honoured"),
    ({"stop_token_ids": [5, 6]}, "completions", "honoured"),
    ({"ignore_eos": True}, "chat", "honoured"),
    ({"max_completion_tokens": 3}, "chat", "honoured"),
    ({"max_completion_tokens": 3, "max_tokens": 3}, "chat", "honoured"),  # both, equal (as some clients send)
    ({"stop": [f"never{i}" for i in range(40)]}, "completions", "honoured"),  # more than OpenAI's 4 / the old 16
    ({"logit_bias": {}}, "completions", "honoured"),
    ({"logit_bias": {"5": 2}}, "completions", "refused"),
    ({"best_of": 2}, "completions", "refused"),
    ({"user": "u1"}, "completions", "ignored"),
    ({"metadata": {"k": "v"}}, "chat", "ignored"),
    ({"store": False}, "chat", "ignored"),
    ({"service_tier": "auto"}, "completions", "ignored"),
    ({"parallel_tool_calls": False}, "chat", "ignored"),
    ({"priority": 0}, "completions", "ignored"),
]


@pytest.mark.parametrize("fields,endpoint,policy", POLICY, ids=[f"{i}-{next(iter(f))}-{p}"
                                                               for i, (f, _, p) in enumerate(POLICY)])
def test_vllm_fields_policy(served, caplog, fields, endpoint, policy):
    base = served[1]
    body = dict({"model": MODEL, "temperature": 0}, **fields)
    body.setdefault("max_tokens", None if "max_completion_tokens" in fields else 6)
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    with caplog.at_level(logging.WARNING, logger="infer.serve"):
        r = httpx.post(f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body,
                       timeout=300)
    if policy == "refused":
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text
        assert r.json()["error"]["param"] == next(iter(fields))
        return
    assert r.status_code == 200, r.text
    if policy == "ignored":
        field = next(iter(fields))
        said = [rec for rec in caplog.records if repr(field) in rec.getMessage() and "ignored" in rec.getMessage()]
        assert len(said) <= 1  # once per field name and process (this test may not be the first to send it)
    if fields.get("include_stop_str_in_output"):
        text = r.json()["choices"][0]["text"]
        assert text.endswith("\n") or r.json()["choices"][0]["finish_reason"] == "length"
    if "min_tokens" in fields:
        assert len(r.json()["choices"][0]["token_ids"]) == 6


def test_ignored_field_warns_once(served, caplog):
    with caplog.at_level(logging.WARNING, logger="infer.serve"):
        for _ in range(2):
            assert httpx.post(served[1] + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "metadata": {"a": "b"}}).status_code == 200
    said = [rec for rec in caplog.records if "'metadata'" in rec.getMessage()]
    assert len(said) <= 1


def test_stop_token_ids_stop_the_answer(served, client, tok):
    service = served[0]
    prompt = tok(PROMPT)["input_ids"]
    free = plain(service, prompt, 12, stop=False)
    stop_id = free[4]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == free[:free.index(stop_id) + 1] and r.choices[0].finish_reason == "stop"


# --- usage ----------------------------------------------------------------------------------------------------
def test_usage_once_or_per_chunk(served, client, tok):
    ask = lambda **kw: list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,  # noqa
                                                      stream=True, extra_body={"ignore_eos": True}, **kw))
    none = ask()
    assert all(ch.usage is None for ch in none)  # no stream_options: no usage at all
    with httpx.stream("POST", served[1] + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        assert not any('"usage"' in line for line in r.iter_lines())  # not even a null field, as OpenAI
    once = ask(stream_options={"include_usage": True})
    assert all(ch.usage is None for ch in once[:-1]) and once[-1].choices == []
    assert once[-1].usage.completion_tokens == 12 and once[-1].usage.prompt_tokens == len(tok(PROMPT)["input_ids"])
    every = ask(stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [ch.usage.completion_tokens for ch in every]
    assert all(ch.usage is not None for ch in every) and counts == sorted(counts) and counts[-1] == 12
    assert sum(ch.usage.completion_tokens for ch in once if ch.usage) == 12  # summing over chunks counts once


def test_a_shared_prompt_prefix_is_cached_and_reported(served, client, tok):
    """Two requests opening with the same long system text: the second reads the first's full prompt pages
    (``usage.prompt_tokens_details.cached_tokens``, the metrics' hits and cached tokens), and its greedy answer
    equals plain decoding; streamed, the final usage chunk carries the same count."""
    service, base = served
    system = "You are a careful assistant. Answer briefly and exactly. " * 6
    before = metrics(base)
    first = client.completions.create(model=MODEL, prompt=system + "Q: one", max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=system + "Q: two", max_tokens=8, temperature=0)
    shared = len(tok(system)["input_ids"]) - 1  # the texts' tokens may merge at the seam
    page = service.engine.pool.page
    assert first.usage.prompt_tokens_details.cached_tokens % page == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= shared // page * page > 0
    ids = tok(system + "Q: two")["input_ids"]
    assert second.choices[0].model_extra["token_ids"] == plain(service, ids, 8)
    after = metrics(base)
    hits = after[("dflash_prefix_cache_hits_total", ())] - before.get(("dflash_prefix_cache_hits_total", ()), 0)
    tokens = after[("dflash_prefix_cache_tokens_total", ())] - before.get(("dflash_prefix_cache_tokens_total", ()), 0)
    assert hits >= 1 and tokens >= second.usage.prompt_tokens_details.cached_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=system + "Q: two", max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= shared // page * page


def test_completion_tokens_stop_at_the_stop_string(served, client, tok):
    service = served[0]
    prompt = tok(PROMPT)["input_ids"]
    free = plain(service, prompt, 40, stop=False)
    text = tok.decode(free)
    stop = text[len(text) // 3: len(text) // 3 + 2]
    for include in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        c = r.choices[0]
        ids = c.model_extra["token_ids"]
        assert c.finish_reason == "stop" and r.usage.completion_tokens == len(ids) < 40
        assert ids == free[:len(ids)] and stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
        cut = text.index(stop) + (len(stop) if include else 0)
        assert c.text == text[:cut]


# --- robustness -------------------------------------------------------------------------------------------------
def test_lone_surrogates_are_400_and_every_outcome_is_counted(served, monkeypatch):
    service, base = served
    before = metrics(base)
    raw = ['{"model": "dflash-demo", "prompt": "a\\udcff"}',
           '{"model": "dflash-demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
           '{"model": "dflash-demo", "prompt": "x", "\\udcff": 1}',
           '{"model": "dflash-demo", "prompt": "x", "stop": ["\\udcff"]}']
    for i, body in enumerate(raw):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(base + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (i, r.text)
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "min_p": 0.5}).status_code == 400
    monkeypatch.setattr(service, "completion_prompts", lambda body: 1 / 0)
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    m = metrics(base)
    assert requests_count(m, "completions", "invalid") == requests_count(before, "completions", "invalid") + 3
    assert requests_count(m, "chat", "invalid") == requests_count(before, "chat", "invalid") + 1
    assert requests_count(m, "completions", "unsupported") == requests_count(before, "completions", "unsupported") + 1
    assert requests_count(m, "completions", "internal") == requests_count(before, "completions", "internal") + 1
    key = ("dflash_http_responses_total", (("route", "/v1/completions"), ("status", "500")))
    assert m[key] == before.get(key, 0) + 1


def test_access_log_line_per_request(served, caplog):
    with caplog.at_level(logging.INFO, logger="infer.serve.access"):
        httpx.get(served[1] + "/health")
        httpx.post(served[1] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "infer.serve.access"]
    assert any('"GET /health" 200' in line for line in lines), lines
    assert any('"POST /v1/completions" 400' in line and line.endswith("s") for line in lines), lines


def test_large_bodies_413_and_tokenized_off_the_event_loop(served, tok):
    """A 10 MB body: 413. A 1.3 MB prompt under the limit is tokenized off the event loop: /health keeps
    answering at once meanwhile (the prompt is then refused: longer than the max length)."""
    base = served[1]
    before = metrics(base)
    huge = json.dumps({"model": MODEL, "prompt": "x" * (10 * 2 ** 20)})
    r = httpx.post(base + "/v1/completions", content=huge, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunked():  # no Content-Length: counted as it arrives
        async def parts():
            for _ in range(10):
                yield b"x" * 2 ** 20
        async with httpx.AsyncClient(timeout=60) as c:
            return await c.post(base + "/v1/completions", content=parts(), headers={"content-type":
                                                                                    "application/json"})
    assert asyncio.run(chunked()).status_code == 413
    assert requests_count(metrics(base), "completions", "too_large") == requests_count(
        before, "completions", "too_large") + 2

    big = "hello world def foo(): return 1 " * 40000  # ~1.3 MB: seconds of tokenization

    async def both():
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(base + "/v1/completions", json={"model": MODEL, "prompt": big}))
            await asyncio.sleep(0.5)
            waits = []
            while not task.done():
                t = time.perf_counter()
                assert (await c.get(base + "/health")).status_code == 200
                waits.append(time.perf_counter() - t)
                await asyncio.sleep(0.1)
            return await task, waits
    r, waits = asyncio.run(both())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert waits and max(waits) < 1.0, waits


def test_disconnected_non_streamed_request_is_cancelled(served, monkeypatch):
    """Its tokens keep coming (sampled, so short acceptances; each step slowed here by 0.05 s, the demo is fast)
    more often than the disconnect poll's period (set to 1 s here), yet the client's leaving is seen within a
    period and the row freed: nothing is counted as generated. (Polling only when no event came for a period,
    the bug of issue 51, never polls here: the client leaves after 3 s, once its tokens are flowing.)"""
    service, base = served
    run = service.engine.run

    def slow(*a, **kw):
        time.sleep(0.05)
        return run(*a, **kw)

    monkeypatch.setattr(service.engine, "run", slow)
    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 1.0)  # longer than any gap between two of its events
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_LENGTH - 16, "temperature": 1, "seed": 0,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(3)]  # its programs compiled: the real request's tokens flow at once
    time.sleep(1)
    before = metrics(base)
    try:
        r = httpx.post(base + "/v1/completions", timeout=3.0, json=body)
        pytest.fail(f"answered before the client left: {r.status_code} {r.text[:300]}")
    except httpx.ReadTimeout:
        pass
    gone = time.monotonic()
    while True:
        m = metrics(base)
        if m[("dflash_slots_busy", ())] == 0 and requests_count(m, "completions", "cancelled") == \
                requests_count(before, "completions", "cancelled") + 1:
            break
        assert time.monotonic() - gone < 3, m
        time.sleep(0.1)
    assert m[("dflash_generation_tokens_total", ())] == before[("dflash_generation_tokens_total", ())]


# --- defaults ---------------------------------------------------------------------------------------------------
def test_defaults_as_vllm(served, client, tmp_path):
    service = served[0]
    assert service.options.temperature == 1.0 and service.default_max_tokens is None  # the demo's config has none
    r = client.completions.create(model=MODEL, prompt=PROMPT, seed=3, extra_body={"ignore_eos": True})
    assert len(r.choices[0].model_extra["token_ids"]) == 16  # completions: 16
    prompt = service.chat_prompt(service_request([{"role": "user", "content": "hi"}]))
    from infer.serve.protocol import ChatRequest, CompletionRequest
    chat = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert service.default_budget(chat, MAX_LENGTH - len(prompt)) == MAX_LENGTH - len(prompt)  # chat: the rest
    assert service.default_budget(CompletionRequest(model=MODEL, prompt="x"), 5) == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95,
                                                                 "do_sample": True}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95}
    args = parse_args(["--target", str(tmp_path)])
    assert resolve_defaults(args) is None and (args.temperature, args.top_p, args.top_k) == (0.6, 0.95, 0)
    args = parse_args(["--target", str(tmp_path), "--temperature", "0", "--max-new-tokens", "64"])
    assert resolve_defaults(args) == 64 and args.temperature == 0 and args.top_p == 0.95


def test_tokenize_and_detokenize(served, tok):
    base = served[1]
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == tok(PROMPT)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LENGTH
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(base + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == served[0].chat_prompt(service_request(messages))
    assert httpx.post(base + "/detokenize", json={"tokens": tok(PROMPT)["input_ids"]}).json()["prompt"] == PROMPT
    assert httpx.post(base + "/detokenize", json={"tokens": [10 ** 6]}).status_code == 400
    assert httpx.post(base + "/tokenize", json={"prompt": "x", "messages": messages}).status_code == 400
    assert httpx.post(base + "/tokenize", content='{"prompt": "\\udcff"}',
                      headers={"content-type": "application/json"}).status_code == 400


def test_vllm_spec_decode_counters(served, client):
    """vLLM's counter names beside the project's: drafts = verify steps, accepted = acceptance - 1 per step,
    per position: how many steps accepted at least position + 1 draft tokens."""
    base = served[1]
    before = metrics(base)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    acc = r.choices[0].model_extra["acceptance_lengths"]
    m = metrics(base)
    grew = lambda name, labels=(): m.get((name, labels), 0) - before.get((name, labels), 0)  # noqa
    assert grew("vllm:spec_decode_num_drafts_total") == len(acc)
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == sum(a - 1 for a in acc)
    assert grew("vllm:spec_decode_num_draft_tokens_total") >= sum(a - 1 for a in acc)
    assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)) == sum(
        1 for a in acc if a > 1)


def test_clients_exact_payloads(served, tok):
    """The bodies guidellm 0.8 and lm-evaluation-harness 0.4 send (copied from their request builders): all
    answered, the streamed ones with usage on every chunk; lm-eval's remote tokenizer probe finds its endpoints."""
    base = served[1]
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and "chat_template" in info
    probe = httpx.post(base + "/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(probe["tokens"], list)
    assert httpx.post(base + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()[
        "tokens"][0] == tok.eos_token_id
    guidellm = [("/v1/completions", {"model": MODEL, "stream": True, "prompt": "hello there",
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                                     "max_tokens": 12, "stop": None, "ignore_eos": True}),
                ("/v1/chat/completions", {"model": MODEL, "stream": True, "max_completion_tokens": 12, "stop": None,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                                          "ignore_eos": True, "messages": [
                                              {"role": "user", "content": [{"type": "text", "text": "hello"}]}]})]
    for path, body in guidellm:
        with httpx.stream("POST", base + path, json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert all(e["usage"] is not None for e in events) and events[-1]["usage"]["completion_tokens"] == 12
    generate_until = {"prompt": ["def f(x):\n", "import os\n"], "model": MODEL, "max_tokens": 32, "temperature": 0,
                      "stop": ["\n\n", "<|endoftext|>"], "seed": 1234}
    r = httpx.post(base + "/v1/completions", json=generate_until, timeout=120)
    assert r.status_code == 200 and sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    context, continuation = tok("def f(x):\n")["input_ids"], tok("    return x")["input_ids"]
    loglikelihood = {"model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1,
                     "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(base + "/v1/completions", json=loglikelihood, timeout=120)
    choice = r.json()["choices"][0]
    ctxlen = len(context)
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]  # lm-eval's parse_logprobs
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    assert len(lps) == len(continuation) and all(lp <= max(top.values()) for lp, top in zip(lps, tops))
    ref = log_softmax(served[0], context + continuation)
    np.testing.assert_allclose(sum(lps), sum(ref[ctxlen + i - 1, t] for i, t in enumerate(continuation)),
                               atol=1e-3)


@pytest.mark.parametrize("flags", [["--plain"], ["--tree-budget", "6"]], ids=["plain", "tree"])
def test_logprobs_equal_across_decoding_methods(served, client, flags):
    """A plain server and a tree-verifying one answer a greedy completion with the same tokens and the same
    logprobs as the DFlash server (the logprobs are the target's, whatever drafted the tokens)."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, echo=True,
                extra_body={"ignore_eos": True})
    want = client.completions.create(**body).choices[0]
    other = build_service(parse_args(["--max-batch", "1", "--max-length", str(MAX_LENGTH), "--no-warm", *flags]))
    with Running(other, warm=False) as running:
        got = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0,
                            timeout=300).completions.create(**body).choices[0]
    assert got.model_extra["token_ids"] == want.model_extra["token_ids"] and got.text == want.text
    np.testing.assert_allclose(got.logprobs.token_logprobs[1:], want.logprobs.token_logprobs[1:], atol=1e-5)
    assert got.logprobs.tokens == want.logprobs.tokens
