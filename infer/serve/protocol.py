"""The OpenAI request bodies the server takes (pydantic models: every field typed, unknown fields refused), the
features it refuses with a reason, and the OpenAI-style error object every failure is answered with."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]
MAX_STOPS = 16  # stop strings per request
MAX_PROMPTS = 64  # prompts in one completions request (each a choice)


class APIError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """The fields completions and chat share: decoding settings, stop strings, streaming."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # an extra field (vLLM's): 0 or -1 = off
    seed: StrictInt | None = Field(None, ge=0, lt=2 ** 63)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1)
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # an extra field: no stop at the target's EOS ids

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        return tuple(dict.fromkeys(stops))

    def check(self) -> None:
        """Refuse what the engine does not do (rather than silently ignoring it)."""
        if self.n != 1:
            raise refuse("n", f"one choice per prompt is supported, got n={self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise refuse("presence_penalty" if self.presence_penalty else "frequency_penalty",
                         "penalties change the target's distribution; not supported (lossless decoding)")
        if self.logit_bias:
            raise refuse("logit_bias", "not supported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream: true", param="stream_options")
        self.stop_strings()


class CompletionRequest(Sampling):
    """``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (one choice each)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None:
            raise refuse("logprobs", "not supported yet")
        if self.best_of not in (None, 1):
            raise refuse("best_of", f"one candidate per prompt is supported, got best_of={self.best_of}")
        if self.echo:
            raise refuse("echo", "not supported")
        if self.suffix:
            raise refuse("suffix", "not supported")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or a list of ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            items = [p]
        else:
            items = list(p)
        if not items or any(len(x) == 0 for x in items):
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if len(items) > MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
        return items


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template(self) -> dict:
        """The {"role", "content"} object a chat template takes (developer = system, text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``: ``messages`` through the target tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # an extra field (vLLM's): passed to the template

    def check(self) -> None:
        super().check()
        if self.logprobs or self.top_logprobs is not None:
            raise refuse("logprobs" if self.logprobs else "top_logprobs", "not supported yet")
        if self.tools:
            raise refuse("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise refuse("tool_choice", "tool calling is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise refuse("response_format", f"only text, got {self.response_format.type!r}")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "max_tokens and max_completion_tokens: give one", param="max_tokens")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union-member steps in an error path


def _path(loc) -> str | None:
    """A field's dotted path from a pydantic error location, without "body" and union-member tags."""
    keep = [str(x) for x in loc if x != "body" and not (isinstance(x, str) and (
        x in TYPE_TAGS or "[" in x or x.startswith(("function-", "literal")) or x.endswith(("Part", "Request"))))]
    return ".".join(keep) or None


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's / FastAPI's validation errors as one 400 error naming the first bad field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    param = _path(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "missing":
        return APIError(400, f"{param}: a required field is missing", param=param, code="missing_field")
    same = list(dict.fromkeys(e.get("msg", "") for e in errors if _path(e.get("loc", ())) == param))
    return APIError(400, f"{param or 'body'}: {' or '.join(same)} (got {str(first.get('input'))[:80]!r})", param=param,
                    code="invalid_type" if "type" in kind or "parsing" in kind else "invalid_value")
