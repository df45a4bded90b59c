"""What a server serves: the models, one ``decode.Engine`` of ``max_batch`` slots and its scheduler, the names it
answers to, and the turning of an API request into checked engine requests (prompt ids, budget, settings)."""
from __future__ import annotations

import dataclasses
import itertools
import os
import time

from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.prompts import PromptError, chat_ids, encode_prompt, token_ids
from dflash_jax.target import Target, check_token_ids
from infer.serve.metrics import Metrics
from infer.serve.protocol import (MAX_CHOICES, APIError, ChatRequest, CompletionRequest, Sampling,
                                  TokenizeRequest)
from infer.serve.scheduler import TURN_MS, Job, QueueFull, Scheduler
from infer.serve.text import TextStream


@dataclasses.dataclass(frozen=True)
class Limits:
    max_batch: int  # decode slots
    max_length: int  # prompt + generated tokens per request (sizes the slots' caches)
    queue_size: int  # requests waiting for a slot before 503
    page: int | None = None  # tokens per cache page (0: a max-length cache per row; None: the platform's default)
    kv_cache_memory: int | None = None  # bytes of the page pool (None: every row at the max length)
    steps_per_turn: int | None = None  # decode steps between two reads of the rows' new tokens (None: paced)
    turn_ms: float = TURN_MS  # paced: a turn runs the steps that fit in about this many milliseconds
    prefix_cache: bool = True  # share the pages of common prompt prefixes (where every layer is paged)
    block_policy: str | None = None  # "auto": the block follows the load (``Engine``'s; measured by the warm-up)


class Service:
    """``options``: the defaults of every request (the command line's decoding flags); ``name``: the model name
    requests must give (``aliases`` are accepted too)."""

    def __init__(self, target: Target, draft, tokenizer, options: DecodeOptions, limits: Limits, *, name: str,
                 aliases: tuple[str, ...] = (), default_max_tokens: int | None = None):
        self.target, self.draft, self.tokenizer, self.options, self.limits = target, draft, tokenizer, options, limits
        self.name, self.names = name, {name, *aliases}
        # a request without max_tokens: this many (cut to the room left), or None: vLLM's rule (completions 16,
        # chat the rest of the context)
        self.default_max_tokens = default_max_tokens
        self.engine = Engine(target, draft, options, max_batch=limits.max_batch, max_length=limits.max_length,
                             sampled=True, page=limits.page, kv_cache_memory=limits.kv_cache_memory,
                             prefix_cache=limits.prefix_cache, block_policy=limits.block_policy, tokenizer=tokenizer)
        self.metrics = Metrics(self.engine.rows, self.engine.spec.max_block)
        self.metrics.follow_blocks(self.engine.buckets(), self.engine.block_table)
        self.scheduler = Scheduler(self.engine, self.metrics, limits.queue_size, limits.steps_per_turn,
                                   limits.turn_ms)
        self.created = int(time.time())
        self._streams = itertools.count(1)  # the key stream of a request that gives no seed
        self._scorer = None

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    @property
    def scorer(self):
        """The log-probability scorer (``logprobs.Scorer``), built on first use."""
        if self._scorer is None:
            from infer.serve.logprobs import Scorer

            self._scorer = Scorer(self.target, self.tokenizer)
        return self._scorer

    def start(self, warm: bool = True, grammars: bool = True) -> None:
        """Compile (and run once) the programs of short prompts, then start the engine thread. ``grammars``: the
        constrained steps too, at every bucket of live rows (skipped where no grammar can be read), so that
        requests with a grammar compile nothing either."""
        if warm:
            self.engine.warm([1], streaming=True, grammars=grammars)
        self.scheduler.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.scheduler.stop(drain, timeout)

    def check_model(self, model: str) -> None:
        if model not in self.names:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    # --- prompts --------------------------------------------------------------------------------------------
    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        out = []
        for i, p in enumerate(body.prompts()):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "text prompts need the target's tokenizer, and its directory has none: send "
                                   "token ids", param="prompt")
                p = encode_prompt({"prompt": p}, self.tokenizer)  # the rule infer.generate encodes text by
                if not p:
                    raise APIError(400, f"prompt {i} encodes to no tokens", param="prompt")
            out.append(list(p))
        return out

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "chat needs the target's tokenizer, and its directory has none", param="messages")
        try:
            return chat_ids(self.tokenizer, [m.as_template() for m in body.messages], body.chat_template_kwargs,
                            add_generation_prompt=True)
        except PromptError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        """``/tokenize``: the ids a completions prompt (or chat messages) of this text would be."""
        if self.tokenizer is None:
            raise APIError(400, "this server's target has no tokenizer", param="prompt")
        body.check()
        if body.messages is not None:
            try:
                return chat_ids(self.tokenizer, [m.as_template() for m in body.messages], body.chat_template_kwargs,
                                add_generation_prompt=body.add_generation_prompt)
            except Exception as e:
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
        if body.add_special_tokens:
            return encode_prompt({"prompt": body.prompt}, self.tokenizer)
        return token_ids(self.tokenizer(body.prompt, add_special_tokens=False))

    def tokenizer_info(self) -> dict:
        """``/tokenizer_info`` (vLLM's): the tokenizer's special tokens and chat template (lm-evaluation-harness
        tokenizes through the server when this and ``/tokenize`` answer)."""
        if self.tokenizer is None:
            raise APIError(404, "this server's target has no tokenizer", code="not_found")
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": self.max_length}

    def detokenize(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            raise APIError(400, "this server's target has no tokenizer", param="tokens")
        try:
            check_token_ids(tokens or [0], self.target.config.vocab_size, "tokens")
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # --- requests -------------------------------------------------------------------------------------------
    def default_budget(self, body: Sampling, room: int) -> int:
        """max_tokens of a request that gives none: the server's (--max-new-tokens), else vLLM's rule."""
        if self.default_max_tokens is not None:
            return min(self.default_max_tokens, room)
        return min(16, room) if isinstance(body, CompletionRequest) else room

    def stop_ids(self, body: Sampling) -> tuple[int, ...]:
        """The request's stop ids: the server's (the target's EOS ids) unless ignore_eos, and its stop_token_ids."""
        extra = list(body.stop_token_ids or ())
        vocab = self.target.config.vocab_size
        bad = [t for t in extra if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"stop_token_ids: {bad} outside the vocabulary [0, {vocab})", param="stop_token_ids")
        return tuple(dict.fromkeys((() if body.ignore_eos else tuple(self.options.stop_token_ids)) + tuple(extra)))

    def grammar(self, body: Sampling):
        """The request's grammar (structured outputs), compiled (cached per grammar), or None; 400 naming the field
        and llguidance's message when it does not compile."""
        given = body.grammar()
        if given is None:
            return None
        field, grammar = given
        if self.tokenizer is None:
            raise APIError(400, f"{field}: structured outputs need the target's tokenizer, and its directory has none",
                           param=field)
        try:
            self.engine.constraints.check(grammar, self.engine.spec)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        return grammar

    def jobs(self, body: Sampling, prompts: list[list[int]], budget: int | None, emit) -> list[Job]:
        """``n`` checked jobs per prompt, choice index = prompt * n + j, each with its own key stream (400 on a bad
        id, a prompt past the max length, a budget that does not fit). A budget of 0 (echo): no job."""
        stops = body.stop_strings()
        stop_ids = self.stop_ids(body)
        grammar = self.grammar(body)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: at most {MAX_CHOICES} choices per request (prompts x n), got "
                           f"{len(prompts)} x {body.n}", param="n")
        jobs = []
        for i, ids in enumerate(prompts):
            room = self.max_length - len(ids)
            where = f"prompt {i} " if len(prompts) > 1 else "the prompt "
            if budget == 0 and room >= 0:  # echo, scored only: the ids checked, nothing generated
                try:
                    check_token_ids(ids, self.target.config.vocab_size, "prompt")
                except ValueError as e:
                    raise APIError(400, f"{where.strip()}: {e}", param="prompt") from None
                continue
            if room < 1:
                raise APIError(400, f"{where}has {len(ids)} tokens; this server's maximum length is {self.max_length}"
                               " tokens (prompt + completion; --max-length), so nothing can be generated",
                               param="prompt" if isinstance(body, CompletionRequest) else "messages",
                               code="context_length_exceeded")
            if budget is not None and budget > room:
                raise APIError(400, f"{where}has {len(ids)} tokens and max_tokens is {budget}: more than this "
                               f"server's maximum length of {self.max_length} tokens (--max-length)",
                               param="max_tokens", code="context_length_exceeded")
            for j in range(body.n):
                request = Request(
                    ids, max_new_tokens=budget if budget is not None else self.default_budget(body, room),
                    temperature=None if body.temperature is None else float(body.temperature),
                    top_k=None if body.top_k is None else max(body.top_k, 0),
                    top_p=None if body.top_p is None else float(body.top_p),
                    seed=body.seed, stream=j if body.seed is not None else next(self._streams),
                    stop_token_ids=stop_ids, grammar=grammar)
                try:
                    self.engine.check([request])
                except ValueError as e:
                    raise APIError(400, f"{where.strip()}: {e}", param="prompt") from None
                text = (TextStream(self.tokenizer, stops, skip_special=body.skip_special_tokens,
                                   include_stop=body.include_stop_str_in_output) if self.tokenizer else NoText())
                jobs.append(Job(request, i * body.n + j, text, emit))
        return jobs

    def submit(self, jobs: list[Job]) -> None:
        try:
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(503, f"{e}; retry shortly", code="server_overloaded", type="server_error",
                           headers={"Retry-After": "1"}) from None

    def health(self) -> tuple[bool, dict]:
        ok = self.scheduler.alive
        return ok, {"status": "ok" if ok else "stopped", "model": self.name,
                    "slots": self.engine.rows, "slots_busy": len(self.scheduler.active),
                    "queue_depth": self.scheduler.queue.qsize(), "max_length": self.max_length,
                    "speculative": self.engine.spec.speculative, "block_size": self.engine.spec.draft_block}


class NoText(TextStream):
    """A target without a tokenizer: token ids only (the text stays empty)."""

    def __init__(self):
        super().__init__(None, ())

    def _decode(self, ids) -> str:
        return ""


def model_name(target_arg: str | None, target_path: str) -> tuple[str, tuple[str, ...]]:
    """(the served name, other names accepted): the demo's, or ``--target`` as given and its folder name."""
    if target_arg is None:
        return "dflash-demo", ()
    return target_arg, tuple({os.path.basename(os.path.normpath(target_arg)), target_path} - {target_arg})
