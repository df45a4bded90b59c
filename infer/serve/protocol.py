"""The OpenAI request bodies the server takes (pydantic models: every field typed, unknown fields refused), the
features it refuses with a reason, the fields it accepts and ignores (one warning per field name), and the
OpenAI-style error object every failure is answered with.

The policy for a field that would change the answer: honoured, or accepted at its neutral value only and refused
otherwise, never silently ignored (docs/serving.md has the table)."""
from __future__ import annotations

import logging
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]
MAX_STOPS = 256  # stop strings per request
MAX_PROMPTS = 64  # prompts in one completions request (each a choice)
MAX_N = 16  # choices per prompt (n)
MAX_CHOICES = 128  # choices per request (prompts x n)
DEFAULT_MAX_BODY = 8 * 2 ** 20  # request bodies above this many bytes: 413 (--max-body-bytes)
MAX_LOGPROBS = 20  # top alternatives per token (completions logprobs, chat top_logprobs), as vLLM's max_logprobs
# fields taken and ignored: bookkeeping that changes no token of the answer (a warning per field name, once)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "priority")
log = logging.getLogger("infer.serve")
_warned: set[str] = set()


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


def warn_ignored(field: str) -> None:
    """Log once per process that a request field is accepted and ignored."""
    if field not in _warned:
        _warned.add(field)
        log.warning("request field %r is accepted and ignored (it does not change the answer)", field)


def first_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in ``value`` (nested lists / dicts) that is not valid Unicode text (a lone
    surrogate such as "\\udcff", which JSON can spell), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = first_surrogate(k, path) or first_surrogate(v, f"{path}.{k}" if path else str(k))
            if bad:
                return bad
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = first_surrogate(v, f"{path}.{i}" if path else str(i))
            if bad:
                return bad
    return None


def check_text(body: BaseModel) -> None:
    """400 where a request holds a string that is not valid Unicode (a lone surrogate)."""
    bad = first_surrogate(body.model_dump(exclude_none=True))
    if bad is not None:
        raise APIError(400, f"{bad}: not valid Unicode text (a lone surrogate)", param=bad, code="invalid_text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage on every chunk (with include_usage)


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
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logit_bias: dict[str, Number] | None = None
    ignore_eos: StrictBool = False  # an extra field: no stop at the target's EOS ids
    # vLLM's extra fields
    stop_token_ids: list[StrictInt] | None = None  # more stop ids (beside the EOS ids unless ignore_eos)
    min_tokens: StrictInt = Field(0, ge=0)
    repetition_penalty: Number | None = None  # 1 (neutral) only
    min_p: Number | None = None  # 0 (neutral) only
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # structured outputs (docs/structured-outputs.md): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs; at most one of them
    response_format: "ResponseFormat | None" = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    structured_outputs: "StructuredOutputs | None" = None
    # taken and ignored (IGNORED)
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    priority: StrictInt | None = None

    def grammar(self):
        """(the field, its ``dflash_jax.grammar.Grammar``) of the structured-output field the request gives, or None
        (400 if more than one, or a malformed one; whether it compiles: ``Service.jobs``)."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.grammar()
        for field in ("guided_json", "guided_regex", "guided_grammar", "guided_choice"):
            if getattr(self, field) is not None:
                given[field] = _grammar_of(field.removeprefix("guided_"), getattr(self, field), field)
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.grammar()
        if len(given) > 1:
            raise APIError(400, f"give one structured-output field, got {', '.join(given)}", param=list(given)[1])
        return next(iter(given.items()), None)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        return tuple(dict.fromkeys(stops))

    def check(self) -> None:
        """Refuse what the engine does not do (rather than silently ignoring it); warn once per ignored field."""
        if self.presence_penalty or self.frequency_penalty:
            raise refuse("presence_penalty" if self.presence_penalty else "frequency_penalty",
                         "penalties change the target's distribution; not supported (lossless decoding); only 0")
        if self.repetition_penalty is not None and self.repetition_penalty != 1:
            raise refuse("repetition_penalty", "penalties change the target's distribution; not supported "
                         f"(lossless decoding); only 1, got {self.repetition_penalty}")
        if self.min_p is not None and self.min_p != 0:
            raise refuse("min_p", f"not supported; only 0 (off), got {self.min_p}")
        if self.logit_bias:
            raise refuse("logit_bias", "not supported (only {})")
        if not self.spaces_between_special_tokens:
            raise refuse("spaces_between_special_tokens", "only true (the tokenizer's own decoding) is supported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream: true", param="stream_options")
        stops = self.stop_strings()
        if self.min_tokens:
            budget = self.token_budget
            if budget is not None and self.min_tokens > budget:
                raise APIError(400, f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({budget})",
                               param="min_tokens")
            if not self.ignore_eos or stops or self.stop_token_ids:
                # honoured only where it holds by itself: keeping a stop token out would change the distribution
                raise refuse("min_tokens", "only with ignore_eos and no stop strings / stop_token_ids (every "
                             "answer then has max_tokens tokens); an answer cannot be kept from stopping early "
                             "without changing the target's distribution")
        for field in IGNORED:
            if getattr(self, field) is not None:
                warn_ignored(field)

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Top alternatives per token asked for (None: no logprobs)."""
        return None


class CompletionRequest(Sampling):
    """``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (one choice each)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo only (the prompt scored, nothing generated)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, self.n):
            raise refuse("best_of", f"best_of must equal n ({self.n}): candidates are not ranked, got "
                         f"best_of={self.best_of}")
        if self.suffix:
            raise refuse("suffix", "not supported")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 only with echo (scoring the prompt)", param="max_tokens",
                           code="invalid_value")
        if self.stream and (self.logprobs is not None or self.echo):
            raise refuse("logprobs" if self.logprobs is not None else "echo", "not supported with stream: true")

    def logprobs_k(self) -> int | None:
        return self.logprobs

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


def _grammar_of(kind: str, value, field: str):
    """The ``dflash_jax.grammar.Grammar`` of one structured-output value of ``kind`` (vLLM's names: json (a schema),
    regex, grammar (EBNF / Lark), choice, json_object); 400 naming ``field`` when it is malformed."""
    from dflash_jax.grammar import Grammar

    make = {"json": Grammar.json_schema, "regex": Grammar.regex, "grammar": Grammar.gbnf, "choice": Grammar.choice,
            "json_object": lambda _: Grammar.json_object()}[kind]
    try:
        return make(value)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


class JsonSchema(BaseModel):
    """``response_format.json_schema``: the schema under ``schema`` (``name``, ``description`` and ``strict`` taken;
    the schema is always followed exactly)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def grammar(self):
        if self.type == "json_object":
            return _grammar_of("json_object", None, "response_format")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format: type json_schema needs json_schema.schema",
                           param="response_format.json_schema")
        return _grammar_of("json", self.json_schema.schema_, "response_format")


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF),
    ``json_object`` (true)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar_: StrictStr | None = Field(None, alias="grammar")
    json_object: StrictBool | None = None

    def grammar(self):
        given = [(n, v) for n, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                     ("grammar", self.grammar_), ("json_object", self.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise APIError(400, f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
                           f"got {[n for n, _ in given] or 'none'}", param="structured_outputs")
        return _grammar_of(*given[0], "structured_outputs")


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``: ``messages`` through the target tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # an extra field (vLLM's): passed to the template

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: only with logprobs: true", param="top_logprobs")
        if self.stream and self.logprobs:
            raise refuse("logprobs", "not supported with stream: true")
        if self.tools:
            raise refuse("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise refuse("tool_choice", "tool calling is not supported")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens: give one (or both equal)", param="max_tokens")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` text (with the tokenizer's special tokens unless
    ``add_special_tokens`` is false) or ``messages`` through the chat template -> the ids."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give one of prompt and messages", param="prompt")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids -> their text."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


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


Sampling.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()
