"""The serving benchmark's load client: streamed greedy completions through the official ``openai`` client
(``drive``), each response as the client saw it (``Sample``), checked and summarised; ``ClientProcess`` runs it in
a process of its own, as any client of a server runs: beside the server, the two would share one interpreter lock
and each would wait on the other's Python."""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import time

import numpy as np


@dataclasses.dataclass
class Sample:
    """One streamed response as the client saw it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    completion_tokens: int
    acceptance_lengths: list[int]
    start: float
    first: float | None
    end: float
    chunks: int
    cached_tokens: int = 0  # the server's usage.prompt_tokens_details.cached_tokens

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.end) - self.start

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens
        return (self.end - self.first) / (n - 1) if self.first is not None and n > 1 else None


async def drive(url: str, model: str, prompts: list, max_tokens, concurrency: int, *, timeout: float = 600,
                **extra) -> list[Sample]:
    """Stream a greedy completion of every prompt (``max_tokens``: one for all, or one per prompt), at most
    ``concurrency`` at a time -> a ``Sample`` per prompt, in order. ``extra``: more request fields (``ignore_eos``,
    ``stop``)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout)
    gate = asyncio.Semaphore(concurrency)
    budgets = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    known = {"stop"}
    fields = {k: v for k, v in extra.items() if k in known}
    body = {k: v for k, v in extra.items() if k not in known}

    async def one(i: int, prompt) -> Sample:
        async with gate:
            start, first, parts, chunks = time.perf_counter(), None, [], 0
            finish, usage, ids, acc = None, None, [], []
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=budgets[i],
                                                     temperature=0, stream=True, stream_options={"include_usage": True},
                                                     extra_body=body or None, **fields)
            async for chunk in stream:
                if chunk.choices:
                    c = chunk.choices[0]
                    if c.text:
                        first = first or time.perf_counter()
                        parts.append(c.text)
                    chunks += 1
                    if c.finish_reason:
                        finish = c.finish_reason
                        extra_fields = c.model_extra or {}
                        ids, acc = extra_fields.get("token_ids", []), extra_fields.get("acceptance_lengths", [])
                if chunk.usage is not None:
                    usage = chunk.usage
            details = getattr(usage, "prompt_tokens_details", None)
            return Sample(i, "".join(parts), ids, finish, usage.completion_tokens if usage else -1, acc, start, first,
                          time.perf_counter(), chunks, getattr(details, "cached_tokens", None) or 0)

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await client.close()


def check_samples(samples: list[Sample]) -> None:
    """Every response complete: a finish reason, and usage equal to the tokens it carried."""
    for s in samples:
        if s.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {s.index}: finish_reason {s.finish_reason!r}")
        if s.completion_tokens != len(s.token_ids):
            raise RuntimeError(f"request {s.index}: usage says {s.completion_tokens} tokens, the answer has "
                               f"{len(s.token_ids)}")


def summarize(samples: list[Sample], wall: float) -> dict:
    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    acc = [a for s in samples for a in s.acceptance_lengths]
    tokens = sum(s.completion_tokens for s in samples)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"requests": len(samples), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "tpot_p50_s": pct(tpot, 50),
            "tpot_p90_s": pct(tpot, 90), "tau": float(np.mean(acc)) if acc else None}


def drive_all(*args, **kw) -> list[Sample]:
    """``drive`` to its end (a process's entry point)."""
    return asyncio.run(drive(*args, **kw))


class ClientProcess:
    """One spawned process that drives the requests (``drive``'s arguments); a context manager."""

    def __init__(self):
        self._pool = multiprocessing.get_context("spawn").Pool(1)

    def drive(self, *args, **kw) -> list[Sample]:
        return self._pool.apply(drive_all, args, kw)

    def close(self) -> None:
        self._pool.close()
        self._pool.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
