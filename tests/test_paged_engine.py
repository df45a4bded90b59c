"""The paged engine (``decode.Engine`` with ``page`` > 0, the default): rows hold pages of one pool, a run steps the
running rows alone, and a pool too small for its load preempts rows and admits them again without changing any
output (greedy or sampled); pages are never leaked or shared; a pool too small for one row fails at start-up."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.decode.pages import PagePool
from dflash_jax.decode.slots import PROGRESS_STEPS
from dflash_jax.state import NO_PAGE
from pairs import backend_compiles, tight_pool

BUDGETS = [30, 12, 26, 7, 22, 18]


def _requests(prompts):
    out = [Request(p, max_new_tokens=b) for p, b in zip((list(prompts) * 2)[:6], BUDGETS)]
    out[2] = Request(out[2].prompt_ids, max_new_tokens=26, temperature=0.9, top_k=30, seed=5)  # a sampled row
    return out


def test_a_small_pool_preempts_rows_without_changing_any_output(trained):
    """A pool of one max-length row and a little more, under 3 rows of load: rows are preempted several times and
    re-admitted (prefilled from their committed tokens), and every output, greedy and sampled, equals a run whose
    pool never runs dry; at the end every page is back in the pool."""
    target, draft, prompts = trained
    requests = _requests(prompts)
    roomy = decode.continuous_generate(target, draft, requests, max_batch=3, stop_token_ids=[], warm=False)
    stats = decode.RunStats()
    tight = decode.continuous_generate(target, draft, requests, max_batch=3, stop_token_ids=[], stats=stats,
                                       kv_cache_memory=tight_pool(target, draft, requests, 3), warm=False)
    assert stats.preemptions >= 2, stats
    for i, (a, b) in enumerate(zip(roomy, tight)):
        assert a.output_ids == b.output_ids, i
        assert a.finish_reason == b.finish_reason and len(b.acceptance_lengths) > 0
    plain = decode.speculative_generate(target, None, [requests[0].prompt_ids], max_new_tokens=30, stop_token_ids=[])
    assert tight[0].output_ids == plain[0].output_ids


def test_engine_pages_follow_its_rows(trained):
    """Through admit / run / release by hand: a row owns the pages its tokens need (and a few steps more), a run
    over one live row of three compiles the one-row bucket, released rows give every page back."""
    target, draft, prompts = trained
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=20, stop_token_ids=()), max_batch=3, max_length=48)
    state = engine.empty()
    state, rows = engine.admit(state, [Request(prompts[0], max_new_tokens=20)])
    assert engine.pool.owned[rows[0]] == engine.pool.pages_for(len(prompts[0]))
    state, taken = engine.run(state)
    assert taken >= 1
    assert engine.pool.capacity(rows[0]) >= len(prompts[0]) + engine.spec.max_block
    # the bucket of one row: run_rows' rows ``at`` (its operands end with at, max_steps) of shape (1,)
    assert any(k[0] == "run_rows" and k[3][1][-2][0] == (1,) for k in engine.used)
    engine.pool.check()
    while engine.finished_rows(state) != rows:
        state, _ = engine.run(state)
    state, (result,) = engine.release(state, rows)
    assert result.output_ids == decode.speculative_generate(target, None, [prompts[0]], max_new_tokens=20,
                                                            stop_token_ids=[])[0].output_ids
    assert len(engine.pool.free) == engine.pool.pages and (engine.pool.table == NO_PAGE).all()


def _stream_launched(engine, state, rows, pending):
    """The server's turns over ``Engine.launch`` by hand: the next run launched before the last one's read is
    collected, finished rows released while a run steps -> (state, each row's tokens as read off the tails)."""
    sent, live = {r: [] for r in rows}, set(rows)
    while live:
        state, launched = engine.launch(state, 2)
        assert launched is not None
        pending.append(launched)
        while len(pending) > 1:
            _, p = engine.collect(pending.pop(0))
            width, done = p["tail"].shape[1], []
            for r in sorted(live):
                fresh = int(p["generated"][r]) - len(sent[r])
                sent[r] += p["tail"][r, width - fresh:].tolist() if fresh > 0 else []
                if int(p["finish"][r]) in (decode.Finish.LENGTH, decode.Finish.STOP):
                    done.append(r)
            if done:
                state, _ = engine.release(state, done)
                live -= set(done)
    for launched in pending:
        engine.collect(launched)
    return state, sent


def test_launched_runs_stream_the_tokens_of_plain_decoding(trained):
    """``launch`` / ``collect`` as the server drives them: every row's streamed tokens equal plain decoding, every
    page is back at the end; an admission waits for the launches, a launch takes 1 to ``PROGRESS_STEPS`` steps; a pool that must preempt dispatches nothing while
    a launch is out (None), and preempts once every read is in."""
    target, draft, prompts = trained
    requests = [Request(p, max_new_tokens=b) for p, b in zip(prompts[:3], (30, 12, 22))]
    opts = DecodeOptions(max_new_tokens=30, stop_token_ids=())
    engine = Engine(target, draft, opts, max_batch=3, max_length=64)
    state, rows = engine.admit(engine.empty(), requests)
    pending = [engine.read(state)]
    with pytest.raises(ValueError, match="collect every launch"):
        engine.admit(state, [Request(prompts[0], max_new_tokens=4)])
    for steps in (0, PROGRESS_STEPS + 1):  # refused before anything is dispatched
        with pytest.raises(ValueError, match=f"launch runs 1 to {PROGRESS_STEPS} steps, asked {steps}"):
            engine.launch(state, steps)
    state, sent = _stream_launched(engine, state, rows, pending)
    for r, req in zip(rows, requests):
        alone = decode.speculative_generate(target, None, [req.prompt_ids], max_new_tokens=req.max_new_tokens,
                                            stop_token_ids=[])[0]
        assert sent[r] == alone.generated_ids, r
    engine.pool.check()
    assert engine.pool.available() == engine.pool.pages and (engine.pool.table == NO_PAGE).all()

    tight = Engine(target, draft, opts, max_batch=3, max_length=64,
                   kv_cache_memory=tight_pool(target, draft, requests, 3))
    state, rows = tight.admit(tight.empty(), requests)
    first = tight.read(state)
    state, refused = tight.launch(state, 2)
    assert refused is None and not tight.take_preempted()  # giving every row its pages would preempt one
    tight.collect(first)
    state, launched = tight.launch(state, 2)
    assert launched is not None and tight.take_preempted()
    tight.collect(launched)


def test_a_warmed_streaming_engine_compiles_nothing_while_serving(trained):
    """After ``warm(streaming=True)`` (a server's start-up), what a server does with a request (admit, its first
    token read, runs of every read size each followed by its progress read, release) compiles nothing: counted by
    jax.monitoring's backend-compile events. (A jitted read compiled again on the first state a run returned.)"""
    target, _, prompts = trained
    engine = Engine(target, None, DecodeOptions(max_new_tokens=8, stop_token_ids=()), max_batch=1, max_length=200)
    engine.warm([len(prompts[0])], streaming=True)
    with backend_compiles() as compiles:
        state, rows = engine.admit(engine.empty(), [Request(prompts[0], max_new_tokens=150)])
        before = engine.progress(state, 1)["generated"][rows[0]]
        for k in (1 << i for i in range(PROGRESS_STEPS.bit_length())):  # 127 steps in all, one token each
            ran = 0
            while ran < k:  # a row short of pages returns early, for the host to give it more
                state, taken = engine.run(state, k - ran)
                ran += taken
            assert engine.progress(state, k)["generated"][rows[0]] == before + k
            before += k
        state, _ = engine.release(state, rows)
    assert compiles == []


def test_a_short_run_compiles_nothing_after_its_warm_up(trained):
    """``continuous_generate``'s warm-up, then its timed run, where prompt + budget is shorter than the smallest
    prompt bucket (``infer.generate --max-new-tokens 4``): the run compiles nothing, so its timings exclude
    compilation. Bugs caught: the warm-up's dummy prompt filled max_length, finished at its prefill and left the
    run program to the timed run; a finished row's results were read by a jitted gather and release compiled again
    for a state a run returned."""
    target, draft, prompts = trained
    requests = [Request(prompts[0][:3], max_new_tokens=4)]
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=4, stop_token_ids=()), max_batch=1, max_length=7)
    engine.warm([3], most_rows=1, tails=[])
    with backend_compiles() as compiles:
        (_, result), = decode.stream_requests(engine, requests)
    assert compiles == [] and result.num_generated == 4


def test_pool_errors(trained):
    target, draft, prompts = trained
    opts = DecodeOptions(max_new_tokens=8, stop_token_ids=())
    with pytest.raises(ValueError, match="one row of the max length"):
        Engine(target, draft, opts, max_batch=2, max_length=64, kv_cache_memory=1000)
    with pytest.raises(ValueError, match="kv_cache_memory must be"):
        Engine(target, draft, opts, max_batch=2, max_length=64, kv_cache_memory=-5)
    with pytest.raises(ValueError, match="page must be"):
        Engine(target, draft, opts, max_batch=2, max_length=64, page=-1)
    probe = Engine(target, draft, opts, max_batch=2, max_length=64)
    need = probe.pool.pages_for(64 - 1 + probe.spec.max_block)
    engine = Engine(target, draft, opts, max_batch=2, max_length=64, kv_cache_memory=need * probe.page_bytes)
    state, _ = engine.admit(engine.empty(), [Request((list(prompts[0]) * 10)[:50])])  # 4 of its 5 pages
    long = Request((list(prompts[1]) * 10)[:40])
    assert not engine.can_admit([long])
    with pytest.raises(ValueError, match="free pages"):
        engine.admit(state, [long])
    assert "pages of 16 tokens" in engine.describe()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "release"]), st.integers(0, 3), st.integers(0, 40)),
                max_size=40))
def test_pages_are_owned_once(ops):
    """Any sequence of grow / release keeps every page free or owned by exactly one row; a grow either gives a row
    all the pages it asked for or changes nothing (too few free)."""
    pool = PagePool(pages=10, page=4, rows=4, columns=6)
    for op, row, tokens in ops:
        if op == "release":
            pool.release(row)
        else:
            before, free = int(pool.owned[row]), len(pool.free)
            ok = pool.grow(row, tokens)
            want = min(pool.pages_for(tokens), pool.columns)
            if ok:
                assert pool.owned[row] == max(before, want)
            else:
                assert want - before > free and pool.owned[row] == before and len(pool.free) == free
        pool.check()
    assert np.all(pool.owned * pool.page == [pool.capacity(r) for r in range(4)])


def test_a_server_with_a_small_pool_answers_every_request_identically(trained):
    """The server's engine thread (``infer.serve.scheduler``) over a pool too small for its load: requests are
    preempted, wait first in line, resume, and every answer equals the request decoded alone (plain, greedy)."""
    import threading

    from infer.serve.metrics import Metrics
    from infer.serve.scheduler import Done, Job, Scheduler
    from infer.serve.service import NoText

    target, draft, prompts = trained
    requests = [Request(r.prompt_ids, max_new_tokens=r.max_new_tokens) for r in _requests(prompts)]
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    opts = DecodeOptions(max_new_tokens=30, stop_token_ids=())
    probe = Engine(target, draft, opts, max_batch=3, max_length=longest)
    pages = probe.pool.pages_for(longest - 1 + probe.spec.max_block) + 1
    engine = Engine(target, draft, opts, max_batch=3, max_length=longest, sampled=True,
                    kv_cache_memory=pages * probe.page_bytes)
    metrics = Metrics(engine.rows, engine.spec.max_block)
    scheduler = Scheduler(engine, metrics, queue_size=16)
    answers, finished = {}, threading.Event()

    def emit(event):
        if isinstance(event, Done):
            answers[event.index] = (event.ids, event.finish_reason)
            if len(answers) == len(requests):
                finished.set()

    scheduler.start()
    try:
        scheduler.submit([Job(r, i, NoText(), emit) for i, r in enumerate(requests)])
        assert finished.wait(600), answers
    finally:
        scheduler.stop(drain=False, timeout=30)
    assert metrics.preemptions._value.get() >= 1
    for i, r in enumerate(requests):
        alone = decode.speculative_generate(target, None, [r.prompt_ids], max_new_tokens=r.max_new_tokens,
                                            stop_token_ids=[])[0]
        assert answers[i] == (alone.generated_ids, "length"), i


@pytest.mark.parametrize("guess", [1.0, 100.0])
def test_the_server_launches_no_run_behind_rows_expected_to_finish(trained, guess):
    """One user, plain decoding, 4 steps a turn, a budget of 9 (the prefill's token, then 4 + 4): two runs and
    no third launched behind them (it would step nothing); with a first guess of 100 tokens a step (wrong: each
    run then waits for the last, none runs ahead) the answer still comes whole, two runs. Either way it equals
    the request decoded alone."""
    import threading

    from infer.serve.metrics import Metrics
    from infer.serve.scheduler import Done, Job, Scheduler
    from infer.serve.service import NoText

    target, _, prompts = trained
    engine = Engine(target, None, DecodeOptions(max_new_tokens=30, stop_token_ids=()), max_batch=2, max_length=64,
                    sampled=True)
    scheduler = Scheduler(engine, Metrics(engine.rows, engine.spec.max_block), queue_size=4, steps_per_turn=4)
    scheduler.rate = guess
    launches, answer, finished = [], [], threading.Event()
    launch = engine.launch

    def counted(state, steps, **kw):
        launches.append(steps)
        return launch(state, steps, **kw)

    engine.launch = counted

    def emit(event):
        if isinstance(event, Done):
            answer.append(event.ids)
            finished.set()

    request = Request(list(prompts[0]), max_new_tokens=9)
    scheduler.start()
    try:
        scheduler.submit([Job(request, 0, NoText(), emit)])
        assert finished.wait(300)
    finally:
        scheduler.stop(drain=False, timeout=30)
    assert launches == [4, 4]
    alone = decode.speculative_generate(target, None, [request.prompt_ids], max_new_tokens=9, stop_token_ids=[])[0]
    assert answer == [alone.generated_ids]


def test_pages_on_a_tensor_mesh_equal_one_device(trained):
    """Params and the pools' KV heads over tensor=2 (rows whole on every device, so the engine pages): every row's
    output and acceptance equal the single-device paged run's, preemptions included."""
    import jax

    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    target, draft, prompts = trained
    requests = [Request(r.prompt_ids, max_new_tokens=r.max_new_tokens) for r in _requests(prompts)]
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    probe = Engine(target, draft, DecodeOptions(max_new_tokens=30, stop_token_ids=()), max_batch=3,
                   max_length=longest)
    memory = (probe.pool.pages_for(longest - 1 + probe.spec.max_block) + 2) * probe.page_bytes
    single = decode.continuous_generate(target, draft, requests, max_batch=3, stop_token_ids=[],
                                        kv_cache_memory=memory)
    mesh = sh.make_mesh("tensor=2", devices=jax.devices()[:2])
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    stats = decode.RunStats()
    out = decode.continuous_generate(ts, ds, requests, max_batch=3, stop_token_ids=[], stats=stats,
                                     kv_cache_memory=memory)
    assert stats.preemptions >= 1
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]
