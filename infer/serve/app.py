"""The HTTP side (FastAPI): the OpenAI routes over a ``Service``, server-sent events for ``stream: true``, and an
OpenAI-style error object for every failure (bad JSON, wrong types, unsupported features, unknown routes and
models, a full queue, an engine failure), never a traceback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.serve.metrics import CONTENT_TYPE_LATEST
from infer.serve.protocol import APIError, ChatRequest, CompletionRequest, validation_error
from infer.serve.scheduler import Delta, Done, Failed
from infer.serve.service import Service

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(service: Service, *, manage: bool = True) -> FastAPI:
    """The app; ``manage``: its lifespan starts the service and, at shutdown, cancels what is left (a caller that
    starts and stops the service itself passes False)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage and not service.scheduler.alive:
            await asyncio.to_thread(service.start)
        yield
        if manage:
            await asyncio.to_thread(service.stop, False)

    app = FastAPI(title="dflash_jax", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return error_response(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        ok, body = service.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": service.created,
                                            "owned_by": "dflash_jax", "max_model_len": service.max_length}]}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(service, body, request, "completions", service.completion_prompts, body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _serve(service, body, request, "chat", lambda b: [service.chat_prompt(b)], body.token_budget)

    return app


async def _serve(service: Service, body, request: Request, endpoint: str, prompts_of, budget):
    """Check, queue and answer one request (streamed or whole)."""
    counted = service.metrics.requests
    try:
        service.check_model(body.model)
        body.check()
        loop, channel = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event):  # called by the engine thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                loop.call_soon_threadsafe(channel.put_nowait, event)

        jobs = service.jobs(body, prompts_of(body), budget, emit)
        service.submit(jobs)
    except APIError:
        counted.labels(endpoint, "error").inc()
        raise
    reply = Reply(service.name, endpoint, body)
    if body.stream:
        return EventSourceResponse(_events(service, reply, jobs, channel, body), ping=15)
    done = {}
    try:
        while len(done) < len(jobs):
            try:
                event = await asyncio.wait_for(channel.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    counted.labels(endpoint, "cancelled").inc()
                    return Response(status_code=499)
                continue
            if isinstance(event, Failed):
                raise APIError(500, event.message)
            if isinstance(event, Done):
                if event.finish_reason == "cancelled":
                    raise APIError(503, "the server is shutting down", code="server_shutdown")
                done[event.index] = event
    except APIError:
        counted.labels(endpoint, "error").inc()
        raise
    finally:
        for j in jobs:
            j.cancel()  # a no-op for a finished job; frees the slot of one whose client left
    counted.labels(endpoint, "ok").inc()
    return reply.whole([done[i] for i in range(len(jobs))])


async def _events(service: Service, reply: "Reply", jobs, channel: asyncio.Queue, body):
    """The server-sent events of a streamed request: a chunk per step with new text, the finish (with usage), then
    ``[DONE]``. A client that goes away cancels its jobs (their slots are freed at the next step)."""
    outcome = "cancelled"  # until the stream ends on its own: a generator closed early lost its client
    try:
        if reply.endpoint == "chat":
            for j in jobs:
                yield reply.chunk(j.index, role=True)
        finished = []
        while len(finished) < len(jobs):
            event = await channel.get()
            if isinstance(event, Delta):
                yield reply.chunk(event.index, text=event.text)
            elif isinstance(event, Failed) or (isinstance(event, Done) and event.finish_reason == "cancelled"):
                message = event.message if isinstance(event, Failed) else "the server is shutting down"
                outcome = "error"
                yield {"data": json.dumps(APIError(500 if isinstance(event, Failed) else 503, message).body())}
                return
            else:
                finished.append(event)
                yield reply.chunk(event.index, done=event, usage=reply.usage(finished) if len(finished) == len(jobs)
                                  else None)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {"data": json.dumps(dict(reply.head("chunk"), choices=[], usage=reply.usage(finished)))}
        outcome = "ok"
        yield {"data": "[DONE]"}
    finally:
        service.metrics.requests.labels(reply.endpoint, outcome).inc()
        for j in jobs:
            j.cancel()


class Reply:
    """The OpenAI response objects of one request (completions or chat; whole or chunks)."""

    def __init__(self, model: str, endpoint: str, body):
        self.model, self.endpoint, self.body = model, endpoint, body
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, kind: str) -> dict:
        obj = {"chat": {"whole": "chat.completion", "chunk": "chat.completion.chunk"},
               "completions": {"whole": "text_completion", "chunk": "text_completion"}}[self.endpoint][kind]
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(done: list[Done]) -> dict:
        prompt = sum(d.prompt_tokens for d in done)
        out = sum(len(d.ids) for d in done)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    @staticmethod
    def extra(d: Done) -> dict:
        """Non-standard fields of a choice (clients ignore them): the generated ids and the acceptance lengths."""
        return {"token_ids": d.ids, "acceptance_lengths": d.acceptance_lengths}

    def whole(self, done: list[Done]) -> dict:
        if self.endpoint == "chat":
            choices = [dict(index=d.index, message={"role": "assistant", "content": d.text}, logprobs=None,
                            finish_reason=d.finish_reason, **self.extra(d)) for d in done]
        else:
            choices = [dict(index=d.index, text=d.text, logprobs=None, finish_reason=d.finish_reason, **self.extra(d))
                       for d in done]
        return dict(self.head("whole"), choices=choices, usage=self.usage(done))

    def chunk(self, index: int, *, text: str | None = None, role: bool = False, done: Done | None = None,
              usage: dict | None = None) -> dict:
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if done else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None}
        choice["finish_reason"] = done.finish_reason if done else None
        if done:
            choice.update(self.extra(done))
        out = dict(self.head("chunk"), choices=[choice])
        if usage is not None:
            out["usage"] = usage
        return {"data": json.dumps(out)}
