"""The HTTP side (FastAPI): the OpenAI routes over a ``Service``, server-sent events for ``stream: true``, and an
OpenAI-style error object for every failure (bad JSON, wrong types, text that is not Unicode, unsupported
features, unknown routes and models, a body over the limit, a full queue, an engine failure), never a traceback.
Every request is counted in /metrics by its outcome and logged in one access line; tokenization and the
log-probability scoring run off the event loop, so one large request cannot stall the others."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.serve.metrics import CONTENT_TYPE_LATEST
from infer.serve.protocol import (DEFAULT_MAX_BODY, APIError, ChatRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest, check_text, first_surrogate, validation_error)
from infer.serve.scheduler import Delta, Done, Failed
from infer.serve.service import Service

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
INLINE_BYTES = 4096  # a request body under this is checked and tokenized on the event loop (well under a
# millisecond): a thread hop there and back costs one user about as much (large ones still go to a thread)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
access = logging.getLogger("infer.serve.access")


class Json(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed in an error message cannot fail the response."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(e: APIError) -> JSONResponse:
    return Json(e.body(), status_code=e.status, headers=e.headers)


def outcome_of(status: int, code: str | None = None) -> str:
    """The ``outcome`` label of a refused or failed request."""
    if status == 400:
        return "unsupported" if code == "unsupported_parameter" else "invalid"
    return {404: "not_found", 413: "too_large", 499: "cancelled", 503: "overloaded"}.get(
        status, "internal" if status >= 500 else "invalid")


def route_of(path: str) -> str:
    """A bounded label for a request path (unknown routes are "other")."""
    return path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                            "/tokenize", "/detokenize", "/tokenizer_info") else "other"


class TooLarge(HTTPException):
    """A body over the limit (an HTTPException: FastAPI passes it through its body parsing as it is)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)")


class Guard:
    """ASGI middleware: 413 for a body over ``max_body`` bytes (by its Content-Length, or counted as it arrives),
    one access log line per request (method, path, status, seconds: to the end of the response, a stream's
    included) and the ``dflash_http_responses_total{route, status}`` count."""

    def __init__(self, app, service: Service, max_body: int, access_log: bool):
        self.app, self.service, self.max_body, self.access_log = app, service, max_body, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, got = time.perf_counter(), [0], [0]
        length = dict(scope.get("headers") or ()).get(b"content-length")

        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                got[0] += len(message.get("body", b""))
                if got[0] > self.max_body:
                    raise TooLarge(self.max_body)
            return message

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise TooLarge(self.max_body)
            await self.app(scope, counted, sending)
        except TooLarge as big:
            if status[0]:  # the response had begun: nothing more can be said
                raise
            e = APIError(413, big.detail, code="request_too_large")
            endpoint = ENDPOINTS.get(scope["path"])
            if endpoint:
                self.service.metrics.requests.labels(endpoint, "too_large").inc()
            await error_response(e)(scope, receive, sending)
        finally:
            route = route_of(scope["path"])
            self.service.metrics.responses.labels(route, str(status[0] or 500)).inc()
            if self.access_log:
                client = scope.get("client") or ("-", 0)
                access.info('%s - "%s %s" %d %.3fs', client[0], scope["method"], scope["path"], status[0] or 500,
                            time.perf_counter() - start)


def create_app(service: Service, *, manage: bool = True, max_body: int = DEFAULT_MAX_BODY,
               access_log: bool = True) -> FastAPI:
    """The app; ``manage``: its lifespan starts the service and, at shutdown, cancels what is left (a caller that
    starts and stops the service itself passes False); ``max_body``: the request body limit in bytes;
    ``access_log``: one info line per request on the ``infer.serve.access`` logger."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage and not service.scheduler.alive:
            await asyncio.to_thread(service.start)
        yield
        if manage:
            await asyncio.to_thread(service.stop, False)

    app = FastAPI(title="dflash_jax", lifespan=lifespan)
    app.add_middleware(Guard, service=service, max_body=max_body, access_log=access_log)

    def refused(request, e: APIError) -> JSONResponse:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint:
            service.metrics.requests.labels(endpoint, outcome_of(e.status, e.code)).inc()
        return error_response(e)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return refused(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = list(e.errors())
        bad = first_surrogate([er.get("input") for er in errors] + [er.get("loc") for er in errors])
        if bad is not None:
            return refused(request, APIError(400, "the body holds text that is not valid Unicode (a lone "
                                             "surrogate)", code="invalid_text"))
        return refused(request, validation_error(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        code = {404: "not_found", 413: "request_too_large"}.get(e.status_code)
        return refused(request, APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        if isinstance(e, UnicodeError):  # text the tokenizer cannot take
            return refused(request, APIError(400, f"the request holds text that is not valid Unicode: {e}",
                                             code="invalid_text"))
        return refused(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

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

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return Json(service.tokenizer_info())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            service.check_model(body.model)
        check_text(body)
        ids = await asyncio.to_thread(service.tokenize, body)
        return Json({"count": len(ids), "max_model_len": service.max_length, "tokens": ids, "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            service.check_model(body.model)
        return Json({"prompt": await asyncio.to_thread(service.detokenize, body.tokens)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(service, body, request, "completions", service.completion_prompts)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _serve(service, body, request, "chat", lambda b: [service.chat_prompt(b)])

    return app


async def _serve(service: Service, body, request: Request, endpoint: str, prompts_of):
    """Check, queue and answer one request (streamed or whole). Refusals raise ``APIError`` (the handlers answer
    and count them)."""
    counted = service.metrics.requests
    service.check_model(body.model)
    body.check()
    loop, channel = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event):  # called by the engine thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            loop.call_soon_threadsafe(channel.put_nowait, event)

    def prepare():  # off the event loop when large: a large prompt takes long to check and tokenize
        check_text(body)
        prompts = prompts_of(body)
        return prompts, service.jobs(body, prompts, body.token_budget, emit)

    small = int(request.headers.get("content-length") or INLINE_BYTES) < INLINE_BYTES
    prompts, jobs = prepare() if small else await asyncio.to_thread(prepare)
    reply = Reply(service, endpoint, body, prompts)
    service.submit(jobs)
    if body.stream:
        return EventSourceResponse(_events(service, reply, jobs, channel, body), ping=15)
    done = {d.index: d for d in reply.scored_only()}  # max_tokens 0 with echo: no job
    try:
        checked = time.monotonic()
        while len(done) < len(prompts) * body.n:
            try:
                event = await asyncio.wait_for(channel.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # events may come faster than the poll
                checked = time.monotonic()
                if await request.is_disconnected():
                    counted.labels(endpoint, "cancelled").inc()
                    return Response(status_code=499)
            if isinstance(event, Failed):
                raise APIError(500, event.message)
            if isinstance(event, Done):
                if event.finish_reason == "cancelled":
                    raise APIError(503, "the server is shutting down", code="server_shutdown")
                done[event.index] = event
    finally:
        for j in jobs:
            j.cancel()  # a no-op for a finished job; frees the slot of one whose client left
    done = [done[i] for i in sorted(done)]
    out = await asyncio.to_thread(reply.whole, done) if reply.blocking else reply.whole(done)
    counted.labels(endpoint, "ok").inc()
    return Json(out)


async def _events(service: Service, reply: "Reply", jobs, channel: asyncio.Queue, body):
    """The server-sent events of a streamed request: a chunk per turn with new text, a finish chunk per choice
    (with its last text, as vLLM sends it), the usage chunk (``stream_options.include_usage``; usage on every chunk
    with ``continuous_usage_stats``), then ``[DONE]``. A client that goes away cancels its jobs (their slots are
    freed at the next step)."""
    outcome = "cancelled"  # until the stream ends on its own: a generator closed early lost its client
    options = body.stream_options
    usage_once = options is not None and options.include_usage
    every = usage_once and options.continuous_usage_stats
    counts: dict[int, int] = {}  # tokens of each choice so far

    def usage():
        return reply.usage_of(sum(counts.values())) if every else None

    try:
        if reply.endpoint == "chat":
            for j in jobs:
                yield reply.chunk(j.index, role=True, usage=usage())
        finished = []
        while len(finished) < len(jobs):
            event = await channel.get()
            if isinstance(event, Delta):
                counts[event.index] = counts.get(event.index, 0) + len(event.ids)
                if event.text:
                    yield reply.chunk(event.index, text=event.text, usage=usage())
            elif isinstance(event, Failed) or (isinstance(event, Done) and event.finish_reason == "cancelled"):
                message = event.message if isinstance(event, Failed) else "the server is shutting down"
                outcome = "internal" if isinstance(event, Failed) else "overloaded"
                yield {"data": json.dumps(APIError(500 if isinstance(event, Failed) else 503, message).body())}
                return
            else:
                finished.append(event)
                counts[event.index] = len(event.ids)
                yield reply.chunk(event.index, text=event.last, done=event, usage=usage())
        if usage_once:
            yield {"data": json.dumps(dict(reply.head("chunk"), choices=[], usage=reply.usage(finished)))}
        outcome = "ok"
        yield {"data": "[DONE]"}
    finally:
        service.metrics.requests.labels(reply.endpoint, outcome).inc()
        for j in jobs:
            j.cancel()


class Reply:
    """The OpenAI response objects of one request (completions or chat; whole or chunks); ``prompts``: its
    prompts' ids (choice i answers prompt i // n)."""

    def __init__(self, service: Service, endpoint: str, body, prompts: list[list[int]]):
        self.service, self.model, self.endpoint, self.body, self.prompts = service, service.name, endpoint, body, \
            prompts
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, kind: str) -> dict:
        obj = {"chat": {"whole": "chat.completion", "chunk": "chat.completion.chunk"},
               "completions": {"whole": "text_completion", "chunk": "text_completion"}}[self.endpoint][kind]
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def prompt_tokens(self) -> int:
        """The prompt tokens of the request: each prompt once per choice (as vLLM counts n > 1)."""
        return sum(len(p) for p in self.prompts) * self.body.n

    def usage_of(self, completion: int) -> dict:
        prompt = self.prompt_tokens()
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(self, done: list[Done]) -> dict:
        """The whole request's usage; ``prompt_tokens_details.cached_tokens``: its prompt tokens read from cached
        pages instead of prefilled (counted per choice, as its prompt tokens are)."""
        return dict(self.usage_of(sum(len(d.ids) for d in done)),
                    prompt_tokens_details={"cached_tokens": sum(d.cached_tokens for d in done)})

    def scored_only(self) -> list[Done]:
        """The choices of a request that generates nothing (completions, max_tokens 0 with echo)."""
        if self.body.token_budget != 0:
            return []
        n = self.body.n
        return [Done(i * n + j, "", [], "length", len(p), []) for i, p in enumerate(self.prompts) for j in range(n)]

    @staticmethod
    def extra(d: Done) -> dict:
        """Non-standard fields of a choice (clients ignore them): the generated ids and the acceptance lengths."""
        return {"token_ids": d.ids, "acceptance_lengths": d.acceptance_lengths}

    @property
    def echo(self) -> bool:
        return self.endpoint == "completions" and self.body.echo

    @property
    def blocking(self) -> bool:
        """Whether ``whole`` runs the logprobs' scoring forward or the echo's decoding (then it runs in a thread)."""
        return self.body.logprobs_k() is not None or self.echo

    def whole(self, done: list[Done]) -> dict:
        """The whole response (``blocking``: the logprobs' scoring forward and the echo's decoding run here)."""
        k, echo = self.body.logprobs_k(), self.echo
        choices = []
        for d in done:
            prompt = self.prompts[d.index // self.body.n]
            logprobs = None
            if k is not None:
                scorer = self.service.scorer
                logprobs = (scorer.chat(prompt, d.ids, k) if self.endpoint == "chat"
                            else scorer.completion(prompt, d.ids, k, echo))
            if self.endpoint == "chat":
                choices.append(dict(index=d.index, message={"role": "assistant", "content": d.text},
                                    logprobs=logprobs, finish_reason=d.finish_reason, **self.extra(d)))
            else:
                text = (self.prompt_text(d.index // self.body.n) if echo else "") + d.text
                choices.append(dict(index=d.index, text=text, logprobs=logprobs, finish_reason=d.finish_reason,
                                    **self.extra(d)))
        return dict(self.head("whole"), choices=choices, usage=self.usage(done))

    def prompt_text(self, i: int) -> str:
        """Prompt i as text (echo): as given, or its ids decoded."""
        given = self.body.prompts()[i]
        if isinstance(given, str):
            return given
        tok = self.service.tokenizer
        return tok.decode(given, skip_special_tokens=False, clean_up_tokenization_spaces=False) if tok else ""

    def chunk(self, index: int, *, text: str | None = None, role: bool = False, done: Done | None = None,
              usage: dict | None = None) -> dict:
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None}
        choice["finish_reason"] = done.finish_reason if done else None
        if done:
            choice.update(self.extra(done))
        out = dict(self.head("chunk"), choices=[choice])
        options = self.body.stream_options
        if options is not None and options.include_usage:  # OpenAI: then every chunk has the field (null or not)
            out["usage"] = usage
        return {"data": json.dumps(out)}
