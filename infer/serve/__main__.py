"""Serve a target (and its DFlash draft) over the OpenAI API: ``python -m infer.serve [--target T --draft D]``.

With no arguments it serves the embedded demo pair on http://127.0.0.1:8000 (model name ``dflash-demo``).
Routes: POST /v1/completions, POST /v1/chat/completions (stream: true gives server-sent events ending in
[DONE]), GET /v1/models, GET /health, GET /metrics (Prometheus text). Requests queue (--queue-size) for at most
--max-batch rows in flight, continuously batched over a paged K/V cache (--kv-cache-memory, --page-size). Defaults of a request that does not
set its own, as vLLM's: temperature / top_p / top_k from the target's generation_config.json, else 1 / 1 / off
(--temperature, --top-p, --top-k given: those; --temperature 0 serves greedy by default); max_tokens: 16 for
completions and the rest of the context for chat (--max-new-tokens given: that, for both). --block-size
auto (the default): the block follows the load, each bucket of live rows verifying the block of the most expected
tokens per second (plain steps where drafting does not pay), from step costs measured at start-up and the
acceptance of finished requests (printed at start-up, in /metrics as dflash_block_size). SIGTERM / Ctrl-C: the
server stops listening, lets the requests in flight finish for up to --shutdown-timeout seconds, cancels the rest,
exits 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from infer.serve.protocol import DEFAULT_MAX_BODY
from infer.flags import (DEFAULT_MAX_BATCH, adaptive_kwargs, add_max_batch_arg, add_model_args, block_policy,
                         decoding_kwargs, die, draft_kwargs, fixed_block_size, paging_kwargs)
from infer.loading import load_models

from dflash_jax.launch import launch
from dflash_jax.decode.slots import PROGRESS_STEPS
from infer.serve.scheduler import TURN_MS

DEFAULT_PORT = 8000
DEFAULT_MAX_LENGTH = 4096  # the default --max-length cap: every slot's cache holds this many tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    # None: not given (the defaults are resolved from the target's generation_config: resolve_defaults)
    p.set_defaults(temperature=None, top_k=None, top_p=None, max_new_tokens=None)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                                                       "interface)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    add_max_batch_arg(s)
    s.add_argument("--queue-size", type=int, default=256,
                   help="requests that may wait for a slot; past it: 503 with Retry-After (default 256)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name requests give (default: dflash-demo for the demo, else --target as given)")
    s.add_argument("--plain", action="store_true", help="serve plain decoding of the target (no draft; the "
                                                        "baseline of the serving benchmark)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="at SIGTERM, seconds the requests in flight may take to finish before they are cancelled "
                        "(default 30)")
    s.add_argument("--turn-ms", type=float, default=TURN_MS,
                   help="while no request waits, the engine runs the decode steps that fit in about this many "
                        f"milliseconds between two reads of the rows' new tokens (default {TURN_MS:g}; a power of two "
                        f"of steps, at most {PROGRESS_STEPS}, from the measured step time; a finishing row returns "
                        "at once): few host round trips per token, tokens streamed in chunks of up to a turn")
    s.add_argument("--steps-per-turn", type=int, default=None,
                   help=f"a fixed number of decode steps per turn instead (1-{PROGRESS_STEPS}; 1: stream every step)")
    s.add_argument("--no-warm", action="store_true",
                   help="skip compiling the short-prompt programs (the constrained steps' too) before serving")
    s.add_argument("--no-warm-grammars", action="store_true",
                   help="compile the constrained steps (structured outputs) on first use instead of at start: a "
                        "shorter start-up for a server that serves few requests with a grammar, which then wait "
                        "for the compiler (each bucket of live rows and block once)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"request bodies above this size get 413 (default {DEFAULT_MAX_BODY})")
    s.add_argument("--no-access-log", action="store_true", help="no access log line per request (method, path, "
                                                                 "status, seconds; at --log-level info)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def check_args(args) -> None:
    """The server's own options, before anything loads."""
    if not 0 <= args.port < 65536:
        die(f"--port must be in [0, 65535], got {args.port}")
    if args.queue_size < 1:
        die(f"--queue-size must be >= 1, got {args.queue_size}")
    if args.max_batch is not None and args.max_batch < 1:
        die(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_length is not None and args.max_length < 2:
        die(f"--max-length must be >= 2, got {args.max_length}")
    if args.steps_per_turn is not None and not 1 <= args.steps_per_turn <= PROGRESS_STEPS:
        die(f"--steps-per-turn must be in [1, {PROGRESS_STEPS}], got {args.steps_per_turn}")
    if not args.turn_ms > 0:
        die(f"--turn-ms must be > 0, got {args.turn_ms}")
    if args.shutdown_timeout < 0:
        die(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.plain and args.draft:
        die("--plain serves the target alone: drop --draft")
    if args.max_body_bytes < 1:
        die(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # OpenAI's (top_k: off)


def generation_defaults(target_dir: str) -> dict:
    """temperature / top_p / top_k of the target's generation_config.json, those it has (vLLM's rule)."""
    import json
    import os

    try:
        with open(os.path.join(target_dir, "generation_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in SAMPLING_DEFAULTS if isinstance(config.get(k), (int, float))}


def resolve_defaults(args) -> int | None:
    """Fill the sampling flags not given from the target's generation_config.json, else OpenAI's defaults; ->
    the server's max_tokens default (None: vLLM's rule), ``args.max_new_tokens`` set for the engine's options."""
    from dflash_jax.checkpoints import resolve_path
    from dflash_jax.demo import DEMO_TARGET

    missing = [k for k in SAMPLING_DEFAULTS if getattr(args, k) is None]
    found = generation_defaults(resolve_path(args.target or DEMO_TARGET)) if missing else {}
    for k in missing:
        setattr(args, k, found.get(k, SAMPLING_DEFAULTS[k]))
    given = args.max_new_tokens
    if given is None:
        args.max_new_tokens = 16  # only the engine options' placeholder: every request gets its own budget
    return given


def build_service(args):
    """Load the models and build the ``Service`` the options describe (the engine is not started)."""
    from dflash_jax.decode import DecodeOptions, cache_length
    from dflash_jax.decode.memory import slots_that_fit
    from infer.serve.service import Limits, Service, model_name

    default_max_tokens = resolve_defaults(args)
    target, draft, tokenizer = load_models(args)
    if args.plain:
        draft = None
    max_length = min(args.max_length or DEFAULT_MAX_LENGTH, target.config.max_position_embeddings)
    kw = dict(decoding_kwargs(args, target), max_length=max_length, block_size=fixed_block_size(args),
              **adaptive_kwargs(args), **draft_kwargs(args))
    try:
        options = DecodeOptions(**kw)
        max_block = options.max_block(draft)
        slots = args.max_batch or slots_that_fit(target, draft, cache_length([1], [max_length - 1], max_block),
                                                 DEFAULT_MAX_BATCH, max_block)
        name, aliases = model_name(args.target, target.path)
        service = Service(target, draft, tokenizer, options,
                          Limits(slots, max_length, args.queue_size, **paging_kwargs(args),
                                 steps_per_turn=args.steps_per_turn, turn_ms=args.turn_ms,
                                 block_policy=block_policy(args, draft)),
                          name=args.served_model_name or name, aliases=aliases,
                          default_max_tokens=default_max_tokens)
    except ValueError as e:
        die(str(e))
    return service


def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    check_args(args)
    import uvicorn
    from sse_starlette.sse import AppStatus

    import jax

    from infer.serve.app import create_app

    service = build_service(args)
    if jax.process_count() > 1:
        die("infer.serve runs on one host (a --mesh over its local devices); multi-host serving is not supported")
    spec = service.engine.spec
    what = f"DFlash, block {spec.draft_block}" if spec.speculative else "plain decoding"
    o = service.options
    print(f"serving {service.name!r}: {what}, requests of up to {service.max_length} tokens; cache: "
          f"{service.engine.describe()}; queue {args.queue_size}; defaults: temperature {o.temperature}, top_p "
          f"{o.top_p}, top_k {o.top_k or 'off'}" + ("" if args.no_warm else "; compiling the short-prompt programs..."),
          file=sys.stderr)
    service.start(warm=not args.no_warm, grammars=not args.no_warm_grammars)
    policy = service.engine.block_policy
    if policy == "auto":
        print("--block-size auto: not measured (--no-warm), every step verifies the block", file=sys.stderr)
    elif policy is not None:
        print(policy.describe(), file=sys.stderr)
    AppStatus.disable_automatic_graceful_drain()  # SIGTERM: let streams in flight finish (--shutdown-timeout)
    logging.basicConfig(level=args.log_level.upper())
    app = create_app(service, max_body=args.max_body_bytes, access_log=not args.no_access_log)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM during run() and raises it again afterwards for the handler it found: a handler of
    # ours turns that into a clean exit (status 0) after the drain, not a death by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        service.stop(drain=False)
        die(f"could not listen on {args.host}:{args.port} (see the message above)")
    service.stop(drain=False, timeout=10)
    print("server stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
