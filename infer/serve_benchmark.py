"""Serving benchmark: ``python -m infer.serve_benchmark [--target T --draft D] [--concurrency 1,4,16]``.

Starts two servers in this process, DFlash and plain decoding of the same target (``--plain``), each on a free
localhost port, and drives both with the same streamed greedy completions through the official ``openai`` client at
each concurrency (a fixed number of requests, at most C in flight; the client runs in a process of its own,
``infer.serve_client``), level by level side by side (each level's two
runs back to back, their order alternating) so that the machine's drift lands on both. With ``--block-size auto``
(the default) the DFlash server's block follows the load; the block per bucket of live rows is reported.
Reported per concurrency and server: output tokens/s (all requests' tokens over the level's span: from the first
request sent to the last response's end, the client's own set-up left out), time to
first token and time per output token after it (p50 / p90), the mean acceptance length, DFlash's speedup over plain, and whether every answer is
identical between the two. Every response is checked (complete, a finish reason, usage equal to its tokens).
Beside each server, the engine itself decodes the same prompts one at a time in this process (what
``infer.benchmark`` measures at batch 1): the server's concurrency-1 output tokens/s over the engine's batch-1
tokens/s is the share of the engine's speed one user gets through the server.
``--url`` drives one server that is already running instead (no comparison). The machine's load average is
printed beside the numbers: publish only what a quiet rerun reproduces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from dflash_jax.launch import launch
from infer.flags import add_model_args, check_page_size, die, parse_ints
from infer.serve.scheduler import TURN_MS
from infer.serve_client import ClientProcess, check_samples, summarize

DEFAULT_CONCURRENCY = "1,4,16"


def opening(level: int, words: int) -> str:
    """A system-prompt-like opening of about ``words`` words, its first word naming the level (each level's first
    wave starts cold: no page of another level's opening matches)."""
    return f"Level {level}. " + " ".join(f"rule{i % 97} holds" for i in range(words // 2)) + "\n"


def run_levels(client: ClientProcess, url: str, model: str, prompts: list, levels: list[int], max_tokens: int,
               num_requests: int, shared_prefix: int = 0) -> dict:
    """Each concurrency level over the first ``num_requests`` prompts, driven by ``client`` -> {level: (summary,
    samples)}. With
    ``shared_prefix`` words, every prompt of a level opens with the same text and the level runs twice: the first
    wave (its opening not cached yet) under the key ``level``, the second under ``(level, 2)``."""
    out = {}
    for c in levels:
        batch = prompts[:num_requests]
        waves = [(c, batch)] if not shared_prefix else [(key, [opening(c, shared_prefix) + p for p in batch])
                                                        for key in (c, (c, 2))]
        for key, wave in waves:
            samples = client.drive(url, model, wave, max_tokens, c)
            wall = max(s.end for s in samples) - min(s.start for s in samples)  # the client's set-up is not timed
            check_samples(samples)
            extra = {} if not shared_prefix else {"wave": 1 if key == c else 2,
                                                  "cached_tokens": sum(s.cached_tokens for s in samples)}
            out[key] = (dict(concurrency=c, **summarize(samples, wall), **extra), samples)
            print(f"  concurrency {c}{'' if key == c else ', second wave'}: "
                  f"{out[key][0]['output_tokens_per_s']:.1f} output tokens/s", file=sys.stderr)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.serve_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("serving benchmark")
    g.add_argument("--url", default=None, help="drive this running server (e.g. http://127.0.0.1:8000/v1) instead "
                                               "of starting DFlash and plain servers here")
    g.add_argument("--model", default=None, help="with --url: the model name (default: the server's first)")
    g.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help=f"requests in flight, comma-separated levels (default {DEFAULT_CONCURRENCY})")
    g.add_argument("--num-requests", type=int, default=32, help="requests per level (default 32)")
    g.add_argument("--max-batch", type=int, default=16, help="the servers' decode slots (default 16)")
    g.add_argument("--page-size", type=int, default=None,
                   help="the servers' tokens per cache page (default: the platform's, as infer.serve's)")
    g.add_argument("--turn-ms", type=float, default=TURN_MS,
                   help=f"the servers' decode turn, as infer.serve's --turn-ms (default {TURN_MS:g})")
    g.add_argument("--prompts-file", default=None, help="text prompts (default: the demo's held-out code prompts)")
    g.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                   help="every prompt of a level opens with the same text of about WORDS words, and the level runs "
                        "twice: a first wave (the opening not cached yet), then a second (its pages cached): time to "
                        "first token of both, and the prompt tokens the server read from cache")
    g.add_argument("--json", action="store_true", help="one JSON object per level and server, then a summary")
    p.set_defaults(max_new_tokens=128, max_length=1024)
    return p.parse_args(argv)


def prompts_of(args) -> list[str]:
    from infer.benchmark import default_prompts
    from infer.prompt_input import read_prompts_file

    if args.prompts_file:
        records = read_prompts_file(args.prompts_file)
        if any("prompt" not in r for r in records):
            die("--prompts-file: the serving benchmark sends text prompts (a \"prompt\" field on every row)")
        prompts = [r["prompt"] for r in records]
    else:
        prompts = default_prompts(args.num_requests)
    if len(prompts) < args.num_requests:
        die(f"--num-requests {args.num_requests}: the prompts file has only {len(prompts)} prompts")
    return prompts


def serve_both(client: ClientProcess, args, prompts, levels) -> dict:
    """DFlash and plain decoding, both served here and driven level by level side by side (each level's two runs
    back to back, the order alternating, so that the machine's drift lands on both) -> {kind: levels' results}."""
    from infer.flags import decoding_kwargs, fixed_block_size
    from infer.loading import load_models
    from infer.serve.launch import Running
    from infer.serve.service import Limits, Service
    from dflash_jax.decode import DecodeOptions
    from dflash_jax.prompts import encode_prompt

    target, draft, tokenizer = load_models(args)
    if draft is None:
        die("the comparison needs a draft (--draft), or drive one server with --url")
    if tokenizer is None:
        die("the serving benchmark sends text prompts: the target needs a tokenizer")
    max_length = min(args.max_length, target.config.max_position_embeddings)
    options = DecodeOptions(**dict(decoding_kwargs(args, target), max_length=max_length,
                                   block_size=fixed_block_size(args)))
    auto = args.block_size == "auto"  # the DFlash server's block follows the load (``Engine``'s block_policy)
    first = opening(max(levels), args.shared_prefix) if args.shared_prefix else ""
    lens = [len(encode_prompt({"prompt": first + p}, tokenizer)) for p in prompts]  # as the server encodes them
    if max(lens) >= max_length:
        die(f"a prompt has {max(lens)} tokens, past --max-length {max_length}")
    services = {}
    for kind, d in (("dflash", draft), ("plain", None)):
        print(f"{kind}: compiling{', measuring step costs per bucket and block' if d and auto else ''}...",
              file=sys.stderr)
        opts = options if d is not None else options.replace(block_size=None)  # the plain server has no block
        limits = Limits(args.max_batch, max_length, 4 * args.num_requests, page=args.page_size, turn_ms=args.turn_ms,
                        block_policy="auto" if d is not None and auto else None)
        service = Service(target, d, tokenizer, opts, limits, name="bench")
        service.engine.warm(lens, streaming=True)  # every prompt bucket compiled before the clock starts
        if service.engine.block_policy is not None:
            print(f"  {service.engine.block_policy.describe()}", file=sys.stderr)
        services[kind] = (service, d, opts)
    out = {kind: {} for kind in services}
    with Running(services["dflash"][0], warm=False) as a, Running(services["plain"][0], warm=False) as b:
        servers = {"dflash": a, "plain": b}
        for server in servers.values():
            # untimed: the HTTP path, and the turns' pace settled at one row (each timed level then measures a
            # server that has served before, as ``engine_batch1``'s untimed first call)
            client.drive(server.url, "bench", prompts[:2], args.max_new_tokens, 1)
        for i, c in enumerate(levels):  # side by side: each level's two runs back to back, in alternating order
            for kind in (("dflash", "plain") if i % 2 == 0 else ("plain", "dflash")):
                print(f"{kind}:", file=sys.stderr)
                out[kind].update(run_levels(client, servers[kind].url, "bench", prompts, [c],
                                            args.max_new_tokens, args.num_requests, args.shared_prefix))
    for kind, (service, d, opts) in services.items():
        if service.engine.block_policy is not None:  # after the levels: the acceptance they taught it
            out[kind]["blocks"] = service.engine.block_table()
            print(f"{kind} after the run: {service.engine.block_policy.describe()}", file=sys.stderr)
        ids = [encode_prompt({"prompt": p}, tokenizer) for p in prompts[:args.num_requests]]
        out[kind]["engine"] = engine_batch1(target, d, ids, opts)
    return out


def engine_batch1(target, draft, prompts: list[list[int]], options) -> dict:
    """The engine alone on ``prompts``, one at a time (``infer.benchmark``'s batch 1), after an untimed first call
    -> {"tokens", "wall_s", "tokens_per_s"}: its generated tokens over the sum of each call's wall time."""
    from dflash_jax.decode import speculative_generate

    kw = dict(max_new_tokens=options.max_new_tokens, stop_token_ids=list(options.stop_token_ids),
              block_size=options.block_size)
    speculative_generate(target, draft, prompts[:1], **kw)  # compiled, untimed
    results = [speculative_generate(target, draft, [p], **kw)[0] for p in prompts]
    tokens, wall = sum(r.num_generated for r in results), sum(r.wall_time_s for r in results)
    print(f"  engine at batch 1: {tokens / wall:.1f} tokens/s", file=sys.stderr)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    levels = parse_ints(args.concurrency, "--concurrency")
    if args.num_requests < 1:
        die(f"--num-requests must be >= 1, got {args.num_requests}")
    check_page_size(args)
    if not args.turn_ms > 0:
        die(f"--turn-ms must be > 0, got {args.turn_ms}")
    prompts = prompts_of(args)
    load = os.getloadavg()
    with ClientProcess() as client:  # the load client in a process of its own, as a server's clients are
        if args.url:
            import openai

            model = args.model or openai.OpenAI(base_url=args.url, api_key="none").models.list().data[0].id
            results = {"server": run_levels(client, args.url, model, prompts, levels, args.max_new_tokens,
                                            args.num_requests, args.shared_prefix)}
        else:
            results = serve_both(client, args, prompts, levels)
    engine = {kind: by.pop("engine") for kind, by in results.items() if "engine" in by}
    blocks = {kind: by.pop("blocks") for kind, by in results.items() if "blocks" in by}
    rows = [dict(server=kind, **summary) for kind, by in results.items() for summary, _ in by.values()]
    summary = {"load_average_start": load, "load_average_end": os.getloadavg(), "max_new_tokens": args.max_new_tokens,
               "num_requests": args.num_requests}
    if "plain" in results:
        d, pl = results["dflash"], results["plain"]
        summary["speedup"] = {c: d[c][0]["output_tokens_per_s"] / pl[c][0]["output_tokens_per_s"] for c in levels}
        summary["identical"] = all(a.token_ids == b.token_ids for c in d for a, b in zip(d[c][1], pl[c][1]))
        summary["engine_batch1_tokens_per_s"] = {k: e["tokens_per_s"] for k, e in engine.items()}
        if 1 in levels:  # one user's share of the engine's own speed
            summary["server_vs_engine"] = {k: results[k][1][0]["output_tokens_per_s"] / e["tokens_per_s"]
                                           for k, e in engine.items()}
    if blocks:
        summary["block_per_bucket"] = blocks
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(summary))
        return 0
    waves = "wave" in rows[0]
    print("| server | concurrency |" + (" wave | cached tokens |" if waves else "") +
          " output tok/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | tau |")
    print("|---|---:|" + ("---:|---:|" if waves else "") + "---:|---:|---:|---:|")
    ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    for r in rows:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        wave = f" {r['wave']} | {r['cached_tokens']} |" if waves else ""
        print(f"| {r['server']} | {r['concurrency']} |{wave} {r['output_tokens_per_s']:.1f} | {ms(r['ttft_p50_s'])} / "
              f"{ms(r['ttft_p90_s'])} | {ms(r['tpot_p50_s'])} / {ms(r['tpot_p90_s'])} | {tau} |")
    if "speedup" in summary:
        print("speedup (DFlash / plain output tokens/s): " + ", ".join(
            f"{x:.2f}x at concurrency {c}" for c, x in summary["speedup"].items())
              + f"; identical answers: {'yes' if summary['identical'] else 'NO'}")
    for kind, ratio in summary.get("server_vs_engine", {}).items():
        print(f"{kind}: the server at concurrency 1 gives {ratio:.2f}x of the engine's batch-1 speed "
              f"({summary['engine_batch1_tokens_per_s'][kind]:.1f} tokens/s)")
    for kind, table in blocks.items():
        print(f"{kind}: block per bucket of live rows at the end (--block-size auto; 1 = plain steps): " +
              ", ".join(f"{b}: {k}" for b, k in table.items()))
    print(f"load average {load[0]:.2f} at the start, {summary['load_average_end'][0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
