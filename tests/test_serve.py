"""``python -m infer.serve`` on the demo pair, driven by the official ``openai`` client: completions and chat,
streamed and whole, equal to plain greedy decoding of the same prompt; 32 concurrent streams; stop strings;
every bad request answered with an OpenAI-style error and the right status; a full queue; a client that leaves
mid-stream frees its slot; /metrics parses as Prometheus text; SIGTERM lets the stream in flight finish and
exits 0. One server process for the module (the CLI as a user starts it), on a free port."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dflash_jax as dj
from dflash_jax.demo import DEMO_TARGET
from infer.serve.app import INLINE_BYTES
from infer.serve_client import ClientProcess, check_samples, drive
from serve_process import serve_cli

SLOTS, QUEUE, MAX_LENGTH = 4, 40, 512
PROMPTS = ["def add(a, b):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n",
           "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(process, base URL, its log file)."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # a fixed block: --block-size auto's start-up probes (every bucket x block) are tested in test_guards_serve.py
    with serve_cli(["--max-batch", str(SLOTS), "--queue-size", str(QUEUE), "--max-length", str(MAX_LENGTH),
                    "--max-new-tokens", "24", "--log-level", "warning", "--block-size", "16"], log) as (proc, base):
        yield proc, base, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    target = dj.load_target(DEMO_TARGET)  # float32, as the server loads it on a CPU (--dtype auto)
    return target, AutoTokenizer.from_pretrained(DEMO_TARGET)


def plain(demo, prompts_ids, budgets, stop=True):
    """Plain greedy decoding of each prompt alone -> its generated ids."""
    target, _ = demo
    stops = list(target.config.eos_token_id) if stop else []
    return [dj.generate(target, [ids], max_new_tokens=n, stop_token_ids=stops)[0].generated_ids
            for ids, n in zip(prompts_ids, budgets)]


def text_of(demo, ids) -> str:
    return demo[1].decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def metrics(base) -> dict:
    """{(name, labels): value} of the server's /metrics, parsed by the Prometheus text parser."""
    r = httpx.get(base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["dflash-demo"]
    assert "pages of 128 tokens" in server[2].read_text()  # the CPU default (the suite's own engines page by 16)
    h = httpx.get(server[1] + "/health").json()
    assert h["status"] == "ok" and h["speculative"] and h["slots"] == SLOTS and h["max_length"] == MAX_LENGTH


def test_completions_equal_plain_decoding(client, demo):
    tok = demo[1]
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    want = plain(demo, ids, [20, 20])
    whole = client.completions.create(model="dflash-demo", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    c = whole.choices[0]
    assert c.model_extra["token_ids"] == want[0] and c.text == text_of(demo, want[0])
    assert c.finish_reason == ("stop" if len(want[0]) < 20 else "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids[0]), len(want[0]))
    assert whole.usage.total_tokens == len(ids[0]) + len(want[0])
    by_ids = client.completions.create(model="dflash-demo", prompt=ids[1], max_tokens=20, temperature=0)
    assert by_ids.choices[0].model_extra["token_ids"] == want[1]
    chunks = list(client.completions.create(model="dflash-demo", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == text_of(demo, want[1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want[1])  # usage once, at the end
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len(chunks) < len(want[1])  # a chunk per step, several tokens each (the draft's acceptance)
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    both = client.completions.create(model="dflash-demo", prompt=ids, max_tokens=20, temperature=0)
    assert [ch.model_extra["token_ids"] for ch in sorted(both.choices, key=lambda c: c.index)] == want


def test_chat_equals_plain_decoding(client, demo):
    tok = demo[1]
    messages = [{"role": "system", "content": "answer in Python"}, {"role": "user", "content": "a stack class"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = plain(demo, [ids], [24])[0]
    whole = client.chat.completions.create(model="dflash-demo", messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text_of(demo, want)
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(model="dflash-demo", messages=messages, temperature=0,
                                                 max_completion_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text_of(demo, want)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "size"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "size": {"enum": [1, 2, 3]}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                              "maxItems": 2}}}


def test_response_format_json_schema_is_plain_constrained_decoding(client, demo):
    """Structured outputs (issue 55) through the openai client: chat with response_format json_schema, whole and
    streamed, greedy: the answer validates against the schema and equals plain constrained decoding of the same
    prompt (the engine without a draft, in this process); vLLM's guided_regex on completions likewise; a schema
    that does not compile is a 400 naming response_format."""
    import jsonschema

    from dflash_jax.decode import Request, continuous_generate
    from dflash_jax.grammar import Grammar

    target, tok = demo
    messages = [{"role": "user", "content": "a stack class"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    eos = list(target.config.eos_token_id)

    def plain_constrained(prompt, grammar):
        out = continuous_generate(target, None, [Request(prompt, max_new_tokens=96, grammar=grammar,
                                                         stop_token_ids=eos)], max_batch=1, tokenizer=tok, warm=False)
        return text_of(demo, out[0].generated_ids)

    want = plain_constrained(ids, Grammar.json_schema(SCHEMA))
    jsonschema.validate(json.loads(want), SCHEMA)
    whole = client.chat.completions.create(model="dflash-demo", messages=messages, max_tokens=96, temperature=0,
                                           response_format=fmt)
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="dflash-demo", messages=messages, max_tokens=96, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    regex = r"[a-z]{2,6}_[0-9]{1,2}"
    prompt = tok(PROMPTS[0])["input_ids"]
    got = client.completions.create(model="dflash-demo", prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                    extra_body={"guided_regex": regex})
    assert got.choices[0].text == plain_constrained(prompt, Grammar.regex(regex))
    assert re.fullmatch(regex, got.choices[0].text)
    for bad, param in (({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                        "response_format"),
                       ({"guided_regex": "[a-"}, "guided_regex"),
                       ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")):
        r = httpx.post(client.base_url.join("chat/completions").__str__(), json={
            "model": "dflash-demo", "messages": messages, "max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_concurrent_streams_each_equal_its_solo_output(server, demo):
    """32 streams with mixed budgets through 4 slots: every one complete, equal to its prompt decoded alone."""
    tok = demo[1]
    prompts = [PROMPTS[i % len(PROMPTS)] + "    " * (i // len(PROMPTS)) for i in range(32)]
    budgets = [1 + (7 * i) % 40 for i in range(32)]
    samples = asyncio.run(drive(server[1] + "/v1", "dflash-demo", prompts, budgets, 32, ignore_eos=True))
    check_samples(samples)
    want = plain(demo, [tok(p)["input_ids"] for p in prompts], budgets, stop=False)
    for s, w, n in zip(samples, want, budgets):
        assert len(w) == n and s.token_ids == w and s.text == text_of(demo, w) and s.finish_reason == "length"


def test_the_benchmarks_client_process_drives_the_same_answers(server, demo):
    """``ClientProcess`` (the serving benchmark's client, spawned): its samples come back whole and equal plain
    decoding, as the in-process ``drive``'s do."""
    tok = demo[1]
    with ClientProcess() as client:
        samples = client.drive(server[1] + "/v1", "dflash-demo", PROMPTS[:2], [6, 9], 2, ignore_eos=True)
    check_samples(samples)
    want = plain(demo, [tok(p)["input_ids"] for p in PROMPTS[:2]], [6, 9], stop=False)
    assert [s.token_ids for s in samples] == want and all(s.end >= s.start for s in samples)


def test_stop_strings_cut_the_text_streamed_or_not(client, demo):
    tok = demo[1]
    want = text_of(demo, plain(demo, [tok(PROMPTS[2])["input_ids"]], [24], stop=False)[0])
    stop = want[len(want) // 2: len(want) // 2 + 3]
    assert stop and stop in want
    cut = want[:want.index(stop)]
    never = [f"\x00never{i:03d}" * 4 for i in range(100)]  # a body over INLINE_BYTES: tokenized in a thread
    assert len(json.dumps(never)) > INLINE_BYTES
    whole = client.completions.create(model="dflash-demo", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                      stop=[stop] + never, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="dflash-demo", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut  # never shown, even in part: held back
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampled_requests_are_reproducible_by_seed(client):
    ask = lambda seed: client.completions.create(model="dflash-demo", prompt=PROMPTS[0], max_tokens=16,  # noqa
                                                 temperature=1.0, top_p=0.9, seed=seed,
                                                 extra_body={"top_k": 50, "ignore_eos": True})
    a, b, c = ask(7), ask(7), ask(8)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert len(c.choices[0].model_extra["token_ids"]) == 16


BAD = [  # (body or raw text, status, the param the error names (None: not checked))
    ('{"model": "dflash-demo", "prompt": "x"', 400, None),  # malformed JSON
    ({"model": "dflash-demo", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "dflash-demo", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "dflash-demo", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "dflash-demo", "prompt": 5}, 400, "prompt"),
    ({"model": "dflash-demo"}, 400, "prompt"),
    ({"model": "dflash-demo", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "dflash-demo", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "dflash-demo", "prompt": "x", "logprobs": 1, "stream": True}, 400, "logprobs"),
    ({"model": "dflash-demo", "prompt": "x", "repetition_penalty": 1.1}, 400, "repetition_penalty"),
    ({"model": "dflash-demo", "prompt": "x", "min_p": 0.05}, 400, "min_p"),
    ({"model": "dflash-demo", "prompt": "x", "min_tokens": 4}, 400, "min_tokens"),  # without ignore_eos
    ({"model": "dflash-demo", "prompt": "x", "stop": ["a"] * 257}, 400, "stop"),
    ({"model": "dflash-demo", "prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ({"model": "dflash-demo", "prompt": "\udcff"}, 400, None),  # a lone surrogate
    ({"model": "dflash-demo", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "dflash-demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "dflash-demo", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": "dflash-demo", "prompt": "x", "made_up": 1}, 400, "made_up"),
    ({"model": "dflash-demo", "prompt": [5, 10 ** 6]}, 400, "prompt"),  # an id outside the vocabulary
    ({"model": "dflash-demo", "prompt": list(range(2, 2 + MAX_LENGTH))}, 400, "prompt"),  # longer than the max
    ({"model": "dflash-demo", "prompt": [5, 6], "max_tokens": MAX_LENGTH}, 400, "max_tokens"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_openai_errors(server, body, status, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server[1] + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_bad_chat_requests_and_routes(server, client):
    base = server[1]
    for body, param in [({"model": "dflash-demo", "messages": []}, "messages"),
                        ({"model": "dflash-demo", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                        ({"model": "dflash-demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                         "top_logprobs"),
                        ({"model": "dflash-demo", "messages": [{"role": "user", "content": "x"}], "n": 17}, "n")]:
        r = httpx.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert client.completions.create(model="dflash-demo", prompt="x", max_tokens=2).choices  # still answering


def test_full_queue_is_503_with_retry_after(server, demo):
    """More long requests at once than slots + queue: the extra ones get 503 and Retry-After; the rest finish."""
    base = server[1]

    async def flood():
        async with httpx.AsyncClient(timeout=300) as c:
            body = {"model": "dflash-demo", "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True}
            return await asyncio.gather(*(c.post(base + "/v1/completions", json=body)
                                          for _ in range(SLOTS + QUEUE + 16)))

    replies = asyncio.run(flood())
    full = [r for r in replies if r.status_code == 503]
    ok = [r for r in replies if r.status_code == 200]
    assert full and len(full) + len(ok) == len(replies)
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "server_overloaded" for r in full)
    assert len({json.dumps(r.json()["choices"][0]["token_ids"]) for r in ok}) == 1  # one prompt, one answer
    assert all(len(r.json()["choices"][0]["token_ids"]) == 200 for r in ok)


def test_disconnect_mid_stream_frees_the_slot(server):
    base = server[1]
    before = metrics(base)
    cancelled = lambda m: m.get(("dflash_requests_total", (("endpoint", "completions"), ("outcome", "cancelled"))), 0)  # noqa
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": "dflash-demo", "prompt": PROMPTS[0], "max_tokens": MAX_LENGTH - 16,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30
    while True:
        m = metrics(base)
        if m[("dflash_slots_busy", ())] == 0 and cancelled(m) == cancelled(before) + 1:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    generated = m[("dflash_generation_tokens_total", ())] - before[("dflash_generation_tokens_total", ())]
    assert generated == 0  # a cancelled request's tokens are not counted as served


def test_metrics_are_prometheus_text(server):
    m = metrics(server[1])
    names = {k[0] for k in m}
    for name in ("dflash_requests_total", "dflash_prompt_tokens_total", "dflash_generation_tokens_total",
                 "dflash_queue_depth", "dflash_slots_busy", "dflash_slots_total", "dflash_acceptance_length_bucket",
                 "dflash_mean_acceptance_length", "dflash_time_to_first_token_seconds_count",
                 "dflash_time_per_output_token_seconds_count"):
        assert name in names, name
    assert m[("dflash_slots_total", ())] == SLOTS
    assert m[("dflash_mean_acceptance_length", ())] > 1.5  # the demo draft accepts several tokens a step
    assert m[("dflash_requests_total", (("endpoint", "completions"), ("outcome", "ok")))] >= 32
    blocks = {int(dict(k[1])["bucket"]): v for k, v in m.items() if k[0] == "dflash_block_size"}
    assert blocks == {1: 16, 2: 16, 4: 16}  # --block-size 16: every bucket of live rows


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(server):
    """Last: SIGTERM stops the server; the stream already running completes ([DONE]) first."""
    proc, base, log = server
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"model": "dflash-demo", "prompt": PROMPTS[3], "max_tokens": 160, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    events = [first] + rest
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] == "length" and len(final["choices"][0]["token_ids"]) == 160
    assert "usage" not in final  # no stream_options: no usage in the stream
    assert proc.wait(timeout=60) == 0
    assert "server stopped" in log.read_text()


def test_bad_options_are_refused_before_loading(capsys):
    """Exit status 2 and the option named, before any model loads: the first as a user runs it (a process of its
    own), the rest through the same ``main`` in this process (a process each cost 4 s of start-up)."""
    from infer.serve.__main__ import main

    cases = [(["--port", "70000"], "--port"), (["--queue-size", "0"], "--queue-size"),
             (["--plain", "--draft", "x"], "--plain"), (["--steps-per-turn", "0"], "--steps-per-turn"),
             (["--turn-ms", "0"], "--turn-ms"), (["--kv-cache-memory", "lots"], "--kv-cache-memory")]
    r = subprocess.run([sys.executable, "-m", "infer.serve", *cases[0][0]], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert r.returncode == 2 and cases[0][1] in r.stderr, r.stderr
    for argv, says in cases[1:]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, err


def test_a_turn_runs_the_steps_that_fit_its_time():
    """Paced turns: one step until a step was timed, then the power of two of steps that fits the turn's time at the
    running seconds per step (at least one, at most PROGRESS_STEPS); a fixed count stays fixed."""
    from dflash_jax.decode.slots import PROGRESS_STEPS
    from infer.serve.scheduler import Pace

    pace = Pace(None, 0.025)
    assert pace.steps() == 1
    pace.ran(10, 0.010)  # 1 ms a step: 25 fit, 16 run
    assert pace.steps() == 16
    pace.ran(0, 5.0)  # a run that took no step says nothing about a step's time
    assert pace.steps() == 16
    for _ in range(30):
        pace.ran(4, 0.4)  # 100 ms a step: one step a turn
    assert pace.steps() == 1
    for _ in range(30):
        pace.ran(100, 0.001)
    assert pace.steps() == PROGRESS_STEPS
    assert Pace(3, 0.025).steps() == 3
