"""The engine thread: requests wait in a bounded queue, are admitted into the free slots of one ``decode.Engine``
between steps, and leave as soon as they finish (a stop id, their budget, a stop string) or their client goes
away; every step's new tokens go out to each request's channel as text at once (streaming).

One thread owns the engine and its state (JAX calls block; the HTTP side never touches the device). Each turn
launches a run of steps and the read of every row's counters and newest tokens after it (``Engine.launch``: a few
bytes per row, not the caches), then sends the previous run's tokens while this one steps: the device does not wait
for the host's text, HTTP and releases (unless every row is expected to finish in the runs launched: then it waits
for them instead of launching one more). An admission waits for the reads launched before it."""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import collections

from dflash_jax.decode import Engine, Finish, Request, Resumed, prepare
from dflash_jax.decode.slots import PROGRESS_STEPS
from infer.serve.metrics import Metrics
from infer.serve.text import TextStream

log = logging.getLogger("infer.serve")
FINISHED = (int(Finish.LENGTH), int(Finish.STOP))
TURN_MS = 100.0  # while no request waits, a turn runs the decode steps that fit in about this many milliseconds
# (a power of two of them, measured from the last turns, at most ``PROGRESS_STEPS``: so a turn runs half to all of
# it): each turn's host work (its launch, read and text) takes the CPU from the steps where the host is the device,
# so longer turns serve faster (the demo pair, 2-core CPU, 50 -> 100 ms: one user's DFlash 1230 -> 1356 tokens/s,
# plain 941 -> 1027; at 64 users 1957 -> 2198 and 1498 -> 1701); a row that finishes returns at once, a waiting
# request makes the next turn one step, and tokens stream in chunks of at most a turn (10 a second)


@dataclasses.dataclass
class Delta:
    """New text of choice ``index`` (``ids``: the tokens it came from; the text may lag them by a held-back tail;
    a Delta may carry ids and no text yet)."""

    index: int
    text: str
    ids: list[int]


@dataclasses.dataclass
class Done:
    """Choice ``index`` finished: its whole text and ids, why ("stop" | "length" | "cancelled"), its prompt's
    length and its acceptance lengths (its timings go to the metrics)."""

    index: int
    text: str
    ids: list[int]
    finish_reason: str
    prompt_tokens: int
    acceptance_lengths: list[int]
    cached_tokens: int = 0  # prompt tokens read from cached pages (a shared prefix), not prefilled
    last: str = ""  # the end of ``text`` no Delta carried (a stream sends it in its finish chunk: one event fewer)


@dataclasses.dataclass
class Failed:
    index: int
    message: str


@dataclasses.dataclass(eq=False)
class Job:
    """One prompt of a request: its decode ``Request``, stop strings, and ``emit`` (thread-safe; events above)."""

    request: Request
    index: int
    text: TextStream
    emit: Callable
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    first_token: float | None = None
    sent: int = 0  # generated tokens already read off the engine
    steps: int = 0  # verify steps already read off the engine
    accepted: list = dataclasses.field(default_factory=list)  # their acceptance lengths, as read
    resume: Resumed | None = None  # preempted (its pages were needed): what admits it again where it stopped
    budget: int = 0  # the tokens it may generate (set at its admission: max_new_tokens, cut to the max length)
    ahead: float = 0.0  # the tokens it is expected to have once the runs launched for it are done

    def rate(self, default: float) -> float:
        """Its tokens per verify step: the mean of its recent steps, else ``default``."""
        recent = self.accepted[-16:]
        return sum(recent) / len(recent) if recent else default

    def cancel(self) -> None:
        self.cancelled.set()

    def done(self, reason: str, acceptance_lengths=(), cached_tokens: int = 0, last: str = "") -> Done:
        """The ``Done`` event of this job as it stands (``last``: the end of its text no Delta carried)."""
        return Done(self.index, self.text.text, list(self.text.answer_ids), reason, len(self.request.prompt_ids),
                    list(acceptance_lengths), cached_tokens, last)


class QueueFull(Exception):
    pass


class Scheduler:
    """Runs ``engine`` in a thread over requests ``submit``ted to a queue of at most ``queue_size`` jobs."""

    def __init__(self, engine: Engine, metrics: Metrics, queue_size: int, steps_per_turn: int | None = None,
                 turn_ms: float = TURN_MS):
        if steps_per_turn is not None and not 1 <= steps_per_turn <= PROGRESS_STEPS:
            raise ValueError(f"steps_per_turn must be in [1, {PROGRESS_STEPS}] (or None: paced by turn_ms), got "
                             f"{steps_per_turn}")
        if not turn_ms > 0:
            raise ValueError(f"turn_ms must be > 0, got {turn_ms}")
        self.engine, self.metrics = engine, metrics
        self.pace = Pace(steps_per_turn, turn_ms / 1000)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._submit = threading.Lock()
        self._stop = threading.Event()
        self._drain = True
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self.active: dict[int, Job] = {}
        self.pending: collections.deque = collections.deque()  # ``Engine.launch``es (and reads) not yet sent, oldest first
        self._delivered = 0.0  # when the last of them was sent
        self.waiting: collections.deque[Job] = collections.deque()  # taken off the queue, first in line: preempted
        self.rate = 1.0  # tokens per verify step of a row, recently (a new row's guess)
        self.alive = False

    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def stop(self, drain: bool, timeout: float | None = None) -> None:
        """Stop the thread: ``drain`` lets the queued and running requests finish first; else they are cancelled."""
        self._drain = drain
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue every job of one request, or none (``QueueFull``)."""
        with self._submit:
            if self._stop.is_set() or not self.alive:
                raise QueueFull("the server is shutting down")
            if self.queue.maxsize - self.queue.qsize() < len(jobs):
                raise QueueFull(f"the request queue is full ({self.queue.maxsize} waiting)")
            for j in jobs:
                self.queue.put_nowait(j)
        self.metrics.queue_depth.set(self.queue.qsize())

    # --- the thread -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        state = self.engine.empty()
        while True:
            if self._stop.is_set() and not (self._drain and (self.active or self.waiting or not self.queue.empty())):
                break
            try:
                state = self._turn(state)
            except Exception as e:  # never a dead server: fail the running requests, start from an empty state
                log.exception("engine step failed")
                for job in list(self.active.values()) + self._take_queue():
                    job.emit(Failed(job.index, f"the engine failed: {type(e).__name__}: {e}"))
                self.active.clear()
                self.pending.clear()
                state = self.engine.empty()
        for job in list(self.active.values()) + self._take_queue():
            job.emit(job.done("cancelled"))
        self.active.clear()
        self.alive = False

    def _take_queue(self) -> list[Job]:
        jobs = list(self.waiting)
        self.waiting.clear()
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                return jobs

    def _admit(self, state):
        free = [r for r in range(self.engine.rows) if r not in self.active]
        new = []
        while len(new) < len(free):
            if self.waiting:
                job = self.waiting.popleft()
            else:
                try:  # wait for work only when there is nothing to step
                    job = self.queue.get(block=not self.active and not new, timeout=0.05)
                except queue.Empty:
                    break
            if job.cancelled.is_set():
                job.emit(job.done("cancelled"))
                continue
            if not self.engine.can_admit([j.resume or j.request for j in new + [job]]):  # pages run out: it waits
                self.waiting.appendleft(job)
                break
            new.append(job)
        self.metrics.queue_depth.set(self.queue.qsize())
        if not new:
            return state, False
        now = time.perf_counter()  # queued until the admission (prefill) begins, as the library's queue_time_s
        state, rows = self.engine.admit(state, [j.resume or j.request for j in new], free[:len(new)])
        for row, job in zip(rows, new):
            if job.resume is None:
                self.metrics.queue_time.observe(now - job.arrived)
            job.budget = int(prepare.budgets([len(job.request.prompt_ids)], [job.request.settings(
                self.engine.options)], self.engine.max_length)[0])
            job.ahead = job.sent + (job.resume is None)  # a new row's prefill gives its first token
            job.resume = None
            self.active[row] = job
        return state, True

    def _count_drafts(self, results) -> None:
        if self.engine.spec.speculative:
            for result in results:
                self.metrics.drafts(result.acceptance_lengths, result.verify_lengths)

    def _turn(self, state):
        """Admit (once the launched runs' tokens are out), drop the cancelled, launch a run of steps, then send the
        previous run's new text and release its finished rows while this one steps on the device (rows the pool
        cannot hold are preempted once the reads are in: they wait, first in line)."""
        if self.pending and self._changes():
            state = self._flush(state)
        admitted = False
        if not self.pending:
            state, admitted = self._admit(state)
        gone = [r for r, j in self.active.items() if j.cancelled.is_set()]
        if gone:
            state, results = self.engine.release(state, gone)
            self._count_drafts(results)
            for r in gone:
                job = self.active.pop(r)
                job.emit(job.done("cancelled"))
        if admitted:  # the first tokens come from the prefill: sent while the first run steps
            self.pending.append(self.engine.read(state))
        self.metrics.slots_busy.set(len(self.active))
        if not self.active:
            return self._flush(state)
        if self.pending and self._finishing():  # a run launched behind them would step nothing
            return self._flush(state)
        k = self.pace.steps() if self.queue.empty() and not self.waiting else 1  # waiting: admit sooner
        state, launched = self.engine.launch(state, k)  # it preempts only with nothing launched before it
        if launched is None:  # a row must give its pages up: once every read is in
            state = self._flush(state)
            state, launched = self.engine.launch(state, k)
        if launched is not None:
            for job in self.active.values():
                job.ahead = max(job.ahead, job.sent) + k * job.rate(self.rate)
        for row, again in reversed(self.engine.take_preempted()):  # first in line again, the oldest first
            job = self.active.pop(row)
            job.resume = again
            self.waiting.appendleft(job)
            self.metrics.preemptions.inc()
        self.pending.append(launched)
        while len(self.pending) > 1:
            state = self._deliver(state, self.pending.popleft())
        return state

    def _finishing(self) -> bool:
        """Whether every running row is expected to reach its budget within the runs launched (at its recent tokens
        per step): then the host waits for them instead of launching one more run behind them, which would find no
        row to step (its launch and read cost one user about 4% of the speed on the demo pair; a row that goes on
        after all is launched at the next turn, a gap of one read)."""
        return all(j.ahead >= j.budget for j in self.active.values())

    def _changes(self) -> bool:
        """Whether this turn admits or drops a request (which waits for the launched runs' reads)."""
        return (len(self.active) < self.engine.rows and (bool(self.waiting) or not self.queue.empty())) or any(
            j.cancelled.is_set() for j in self.active.values())

    def _flush(self, state):
        """Every launched run's tokens sent."""
        while self.pending:
            state = self._deliver(state, self.pending.popleft())
        for job in self.active.values():  # nothing launched: what each row has is what it will have
            job.ahead = job.sent
        return state

    def _deliver(self, state, launched):
        """A launch's read in (waiting for its run), its tokens out (``_send``); its pace measured."""
        taken, p = self.engine.collect(launched)
        now = time.perf_counter()
        if launched.spec is not None:
            self.pace.ran(taken, now - max(launched.begun, self._delivered))
        self._delivered = now
        return self._send(state, p, taken)

    def _send(self, state, p: dict, taken: int = 0):
        """Every row's new tokens in the read ``p`` out as text; the finished answered (their acceptance lengths as
        read; their last text in the ``Done``), then released."""
        width = p["tail"].shape[1]
        done, accepted = [], []
        for r, job in self.active.items():
            fresh = int(p["steps"][r]) - job.steps  # the verify steps this row took in the turn's run
            if fresh > 0:
                job.steps = int(p["steps"][r])
                job.accepted += p["acceptances"][r, -fresh:].tolist()
                accepted += job.accepted[-fresh:]
                self.rate = 0.7 * self.rate + 0.3 * sum(job.accepted[-fresh:]) / fresh
            n = int(p["generated"][r])
            new = p["tail"][r, width - (n - job.sent):].tolist() if n > job.sent else []
            job.sent = n
            if new and job.first_token is None:
                job.first_token = time.perf_counter()
            delta, stopped = job.text.push(new)
            if stopped or int(p["finish"][r]) in FINISHED:  # its new text goes out with its Done
                done.append((r, "stop" if stopped or int(p["finish"][r]) == Finish.STOP else "length", delta))
            elif delta or new:
                job.emit(Delta(job.index, delta, new))
        if taken:
            self.metrics.step(accepted, taken)
        if done:  # answered before their rows' release: a client's next request does not wait for it
            now = time.perf_counter()
            for r, reason, delta in done:
                job = self.active.pop(r)
                last = delta + job.text.finish()
                out = len(job.text.answer_ids)
                self.metrics.generation_tokens.inc(out)
                self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
                self.metrics.latency.observe(now - job.arrived)
                if job.first_token is not None:
                    self.metrics.ttft.observe(job.first_token - job.arrived)
                    if out > 1:
                        self.metrics.tpot.observe((now - job.first_token) / (out - 1))
                cached = self.engine.cached(r)
                self.metrics.cached_tokens.inc(cached)
                self.metrics.prefix_hits.inc(cached > 0)
                job.emit(job.done(reason, job.accepted, cached, last))
            state, results = self.engine.release(state, [r for r, *_ in done])
            self._count_drafts(results)
        self.metrics.slots_busy.set(len(self.active))
        if self.engine.paged:
            self.metrics.pages_free.set(self.engine.pool.available())
            self.metrics.evictions.set(self.engine.pool.evictions)
        return state


class Pace:
    """How many decode steps a turn runs: ``fixed``, or the power of two of them that fits in ``turn_s`` seconds at
    the recent seconds per step (each turn's wall time over its steps, host round trip included: a running mean)."""

    def __init__(self, fixed: int | None, turn_s: float):
        self.fixed, self.turn_s = fixed, turn_s
        self.step_s: float | None = None  # unknown: the first turn runs one step

    def steps(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.step_s is None:
            return 1
        fit = max(int(self.turn_s / max(self.step_s, 1e-9)), 1)
        return min(1 << (fit.bit_length() - 1), PROGRESS_STEPS)

    def ran(self, taken: int, seconds: float) -> None:
        if taken > 0:
            now = seconds / taken
            self.step_s = now if self.step_s is None else 0.7 * self.step_s + 0.3 * now
