"""The engine thread: requests wait in a bounded queue, are admitted into the free slots of one ``decode.Engine``
between steps, and leave as soon as they finish (a stop id, their budget, a stop string) or their client goes
away; every step's new tokens go out to each request's channel as text at once (streaming).

One thread owns the engine and its state (JAX calls block; the HTTP side never touches the device). It reads each
row's counters and newest tokens after every step (``Engine.progress``: a few bytes per row, not the caches)."""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import collections

from dflash_jax.decode import Engine, Finish, Request, Resumed
from infer.serve.metrics import Metrics
from infer.serve.text import TextStream

log = logging.getLogger("infer.serve")
FINISHED = (int(Finish.LENGTH), int(Finish.STOP))
STEPS_PER_TURN = 4  # decode steps on the device between two host reads while no request waits (a row that
# finishes returns at once): fewer round trips per token, new tokens streamed in chunks of at most this many steps


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
    resume: Resumed | None = None  # preempted (its pages were needed): what admits it again where it stopped

    def cancel(self) -> None:
        self.cancelled.set()

    def done(self, reason: str, acceptance_lengths=()) -> Done:
        """The ``Done`` event of this job as it stands."""
        return Done(self.index, self.text.text, list(self.text.answer_ids), reason, len(self.request.prompt_ids),
                    list(acceptance_lengths))


class QueueFull(Exception):
    pass


class Scheduler:
    """Runs ``engine`` in a thread over requests ``submit``ted to a queue of at most ``queue_size`` jobs."""

    def __init__(self, engine: Engine, metrics: Metrics, queue_size: int, steps_per_turn: int = 1):
        if steps_per_turn < 1:
            raise ValueError(f"steps_per_turn must be >= 1, got {steps_per_turn}")
        self.engine, self.metrics, self.steps_per_turn = engine, metrics, steps_per_turn
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._submit = threading.Lock()
        self._stop = threading.Event()
        self._drain = True
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self.active: dict[int, Job] = {}
        self.waiting: collections.deque[Job] = collections.deque()  # taken off the queue, first in line: preempted
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
            return state
        now = time.perf_counter()  # queued until the admission (prefill) begins, as the library's queue_time_s
        state, rows = self.engine.admit(state, [j.resume or j.request for j in new], free[:len(new)])
        for row, job in zip(rows, new):
            if job.resume is None:
                self.metrics.queue_time.observe(now - job.arrived)
            job.resume = None
            self.active[row] = job
        return state

    def _count_drafts(self, results) -> None:
        if self.engine.spec.speculative:
            for result in results:
                self.metrics.drafts(result.acceptance_lengths, result.verify_lengths)

    def _turn(self, state):
        """Admit, drop the cancelled, one step (rows the pool cannot hold are preempted: they wait, first in line),
        send every row's new text, release the finished."""
        state = self._admit(state)
        gone = [r for r, j in self.active.items() if j.cancelled.is_set()]
        if gone:
            state, results = self.engine.release(state, gone)
            self._count_drafts(results)
            for r in gone:
                job = self.active.pop(r)
                job.emit(job.done("cancelled"))
        self.metrics.slots_busy.set(len(self.active))
        if not self.active:
            return state
        k = self.steps_per_turn if self.queue.empty() and not self.waiting else 1  # waiting: admit sooner
        state, taken = self.engine.run(state, k)
        for row, again in reversed(self.engine.take_preempted()):  # first in line again, the oldest first
            job = self.active.pop(row)
            job.resume = again
            self.waiting.appendleft(job)
            self.metrics.preemptions.inc()
        p = self.engine.progress(state, self.steps_per_turn)
        width = p["tail"].shape[1]
        done, accepted = [], []
        for r, job in self.active.items():
            fresh = int(p["steps"][r]) - job.steps  # the verify steps this row took in the turn's run
            if fresh > 0:
                job.steps = int(p["steps"][r])
                accepted += p["acceptances"][r, -fresh:].tolist()
            n = int(p["generated"][r])
            new = p["tail"][r, width - (n - job.sent):].tolist() if n > job.sent else []
            job.sent = n
            if new and job.first_token is None:
                job.first_token = time.perf_counter()
            delta, stopped = job.text.push(new)
            if stopped and new:  # the ids past the one that completed a stop string are not the answer's
                new = new[:max(len(job.text.answer_ids) - (len(job.text.ids) - len(new)), 0)]
            if delta or new:
                job.emit(Delta(job.index, delta, new))
            if stopped or int(p["finish"][r]) in FINISHED:
                done.append((r, "stop" if stopped or int(p["finish"][r]) == Finish.STOP else "length"))
        if taken:
            self.metrics.step(accepted, taken)
        if done:
            state, results = self.engine.release(state, [r for r, _ in done])
            self._count_drafts(results)
            now = time.perf_counter()
            for (r, reason), result in zip(done, results):
                job = self.active.pop(r)
                tail = job.text.finish()
                if tail:
                    job.emit(Delta(job.index, tail, []))
                out = len(job.text.answer_ids)
                self.metrics.generation_tokens.inc(out)
                self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
                self.metrics.latency.observe(now - job.arrived)
                if job.first_token is not None:
                    self.metrics.ttft.observe(job.first_token - job.arrived)
                    if out > 1:
                        self.metrics.tpot.observe((now - job.first_token) / (out - 1))
                job.emit(job.done(reason, result.acceptance_lengths))
        self.metrics.slots_busy.set(len(self.active))
        if self.engine.paged:
            self.metrics.pages_free.set(len(self.engine.pool.free))
        return state
