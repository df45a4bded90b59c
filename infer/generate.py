"""Generate with DFlash speculative decoding: ``python -m infer.generate [--target T --draft D] ...``.

With no arguments it runs the embedded demo pair (a small stdlib code model and its draft) offline.
``--json`` prints one object per prompt per line, in input order: index, output_ids (prompt + generated),
acceptance_lengths (one per verify step, each counting the bonus token), tokens_per_second, and more.
Prompts stream through ``--max-batch`` slots (continuous batching: a finished row takes the next prompt at
once); a JSONL prompts-file row may set its own max_new_tokens, temperature, top_p, top_k and seed.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash_jax.launch import launch
from infer.flags import (adaptive_kwargs, add_max_batch_arg, add_model_args, block_policy, decoding_kwargs, die,
                         draft_kwargs, exits_on_interrupt, max_batch, paging_kwargs, resolve_block, shows_bar)
from infer.loading import load_models
from infer.prompt_input import check_overrides, encode, read_prompts_file, requests_of

DEMO_PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of the text file at path."""\n'


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("prompts (default: a demo code prompt)")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line (\\n = newline), or JSONL with a 'prompt' "
                                          "(text) or 'prompt_ids' field")
    g.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    add_max_batch_arg(g)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    o.add_argument("--logprobs", action="store_true",
                   help="each row's log-probabilities: the target's of every generated token at the row's "
                        "temperature (greedy: 1), from the verify forwards (a 'logprobs' list under --json, their "
                        "sum otherwise)")
    o.add_argument("--stream", action="store_true", help="print tokens as each step accepts them (batch of 1 "
                                                         "prompt at a time; host loop over the same jitted step); "
                                                         "the one mode that measures time_to_first_token_s (batched "
                                                         "rows reach the host only when they finish)")
    o.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="also run plain decoding of the same prompts and print both speeds, the speedup and whether "
                        "the outputs are identical (default: on for the demo pair, off with --target; "
                        "--no-baseline skips it)")
    return p.parse_args(argv)


def prompt_sources(args) -> tuple[list[list[int]], list[dict]]:
    """The ``--prompt-ids`` rows and the text / file records, read and checked before any model loads."""
    ids = []
    for s in args.prompt_ids:
        try:
            row = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            die(f"--prompt-ids {s!r}: expected comma-separated integers")
        if not row:
            die("--prompt-ids: empty prompt")
        ids.append(row)
    records = [{"prompt": t} for t in args.prompt]
    if args.prompts_file:
        records += read_prompts_file(args.prompts_file)
    return ids, records


def records_of(sources) -> list[dict]:
    """Every prompt as a record (``--prompt-ids`` rows first, as ``prompt_ids`` orders them), for the checks
    before loading."""
    ids, records = sources
    return [{"prompt_ids": row} for row in ids] + records


def overrides_of(sources) -> list[dict]:
    """Each prompt's own decoding settings (JSONL rows: ``prompts.OVERRIDES``), in ``prompt_ids``' order."""
    from dflash_jax.prompts import OVERRIDES

    ids, records = sources
    return [{}] * len(ids) + [{k: r[k] for k in OVERRIDES if k in r} for r in records] or [{}]


def prompt_ids(args, tokenizer, sources=None) -> list[list[int]]:
    """All prompts as ids: the ``--prompt-ids`` rows, then the text records encoded (the demo prompt when
    there are none); ``sources``: ``prompt_sources(args)`` when already read."""
    ids, records = sources or prompt_sources(args)
    if records:
        ids = ids + encode(tokenizer, records, args.chat)
    return ids or encode(tokenizer, [{"prompt": DEMO_PROMPT}])


def streamed(args, target, draft, tokenizer, prompts, overrides, *, spec_kw: dict) -> list:
    """--stream: each prompt's tokens printed as they are committed (unless --json); the results."""
    from dflash_jax.decode import stream_generate

    results = []
    for p, own in zip(prompts, overrides):
        if tokenizer is not None and not args.json:
            sys.stdout.write(tokenizer.decode(p))
        for event in stream_generate(target, draft, [p], **dict(spec_kw, **own)):
            if event and isinstance(event[0], list):
                if not args.json:
                    new = event[0]
                    sys.stdout.write(tokenizer.decode(new) if tokenizer is not None else
                                     "".join(f" {t}" for t in new))
                    sys.stdout.flush()
            else:
                results += event
        if not args.json:
            sys.stdout.write("\n")
    return results


def overall_rate(results: list, stats) -> str:
    """The run's throughput (every generated token over its wall time), beside which each row's own
    tokens_per_second (its tokens from admission to its last token) is a per-request figure."""
    tokens = sum(r.num_generated for r in results)
    return (f"{tokens} tokens: {tokens / max(stats.wall_time_s, 1e-9):.1f} tokens/s overall (per row: its own, from "
            "admission to its last token)")


def _decode(args, target, draft, requests, slots: int, **kw):
    """The requests through ``slots`` continuously batched slots, with a progress bar over a prompts file on
    stderr (none for one prompt, nor under --json off a terminal)."""
    from dflash_jax.decode import continuous_generate
    from dflash_jax.progress import progress_bar

    with progress_bar(len(requests), f"generate ({'DFlash' if draft is not None else 'plain'})", "prompt",
                      len(requests) > 1 and shows_bar(args)) as bar:
        return continuous_generate(target, draft, requests, max_batch=slots, on_result=lambda i, r: bar.update(1),
                                   **paging_kwargs(args), **kw)


@exits_on_interrupt
def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    if args.chat and not (args.prompt or args.prompts_file):
        die("--chat applies to text prompts: pass --prompt or --prompts-file")
    from dflash_jax.decode import RunStats
    from dflash_jax.decode.memory import param_dtype

    sources = prompt_sources(args)  # every option the command line alone can check, before loading
    overrides = overrides_of(sources)
    check_overrides(args, overrides)
    extra = dict(**adaptive_kwargs(args), **draft_kwargs(args))
    target, draft, tokenizer = load_models(args, records_of(sources))
    prompts = prompt_ids(args, tokenizer, sources)
    if args.baseline is None:  # the first run (the demo) shows what DFlash does: plain decoding beside it
        args.baseline = args.target is None
    args.baseline = args.baseline and draft is not None
    kw = decoding_kwargs(args, target)
    # --block-size auto: the engine's block follows its live rows (streamed runs: one block probed beforehand)
    policy = None if args.stream else block_policy(args, draft, args.max_new_tokens)
    block = None if policy else resolve_block(args, target, draft, prompts, kw)[0]
    spec_kw = dict(kw, block_size=block, **extra, **({"logprobs": 0} if args.logprobs else {}))
    requests = requests_of(prompts, overrides)
    stats = RunStats()
    try:
        slots = max_batch(args, target, draft, prompts, overrides, spec_kw)
        if args.stream:
            results = streamed(args, target, draft, tokenizer, prompts, overrides, spec_kw=spec_kw)
        else:
            results = _decode(args, target, draft, requests, slots, stats=stats, block_policy=policy, **spec_kw)
        baseline = _decode(args, target, None, requests, slots, **kw) if args.baseline else None
    except ValueError as e:
        die(str(e))
    import jax

    if jax.process_index() != 0:  # multi-host (--mesh over a pod): every process has the results; one prints
        return 0
    if not args.json:
        print("(tokens/s exclude one-time setup: each program is compiled and run once before it is timed)",
              file=sys.stderr)
    if not args.stream:
        print(f"continuous batching: {len(prompts)} prompts through {stats.slots} slots in {stats.wall_time_s:.2f} s, "
              f"{overall_rate(results, stats)}, slot occupancy {stats.occupancy:.2f}, {stats.programs} programs "
              "compiled", file=sys.stderr)
        if stats.blocks:
            print("--block-size auto: block per bucket of live rows (1 = plain steps): "
                  + ", ".join(f"{b} rows: {k}" for b, k in stats.blocks.items()), file=sys.stderr)
    for i, r in enumerate(results):
        row = dict(index=i, **r.to_json())
        row["dtype"] = param_dtype(target)
        if tokenizer is not None:
            row["text"] = tokenizer.decode(r.generated_ids)
        if baseline is not None:
            b = baseline[i]
            row["baseline_tokens_per_second"] = b.tokens_per_second
            row["speedup"] = r.tokens_per_second / b.tokens_per_second
            row["identical_to_baseline"] = b.output_ids == r.output_ids
        if args.json:
            print(json.dumps(row))
            continue
        if not args.stream:
            body = tokenizer.decode(r.output_ids) if tokenizer is not None else " ".join(map(str, r.output_ids))
            print(body)
        print(f"--- {r.num_generated} tokens, tau {r.mean_acceptance_length:.2f} over {len(r.acceptance_lengths)} "
              f"steps, {r.tokens_per_second:.1f} tokens/s ({'DFlash' if draft is not None else 'plain'}), "
              f"finish: {r.finish_reason}")
        if r.logprobs is not None:
            print(f"--- log-probability of the generated tokens: {sum(r.logprobs):.3f} (mean "
                  f"{sum(r.logprobs) / max(len(r.logprobs), 1):.3f} per token)")
        if "verify_lengths" in spec_kw and r.verify_lengths:
            print(f"--- adaptive verify: {sum(r.verify_lengths) / len(r.verify_lengths):.2f} tokens verified per step "
                  f"(lengths {','.join(map(str, r.verify_lengths))})")
        if "tree_budget" in spec_kw and r.verify_lengths:
            print(f"--- tree verify: {args.tree_budget} nodes, {r.verify_lengths[0]} tokens verified per step")
        if r.time_to_first_token_s is not None and r.num_generated > 1:
            after = (r.num_generated - 1) / max(r.wall_time_s - r.time_to_first_token_s, 1e-9)
            print(f"--- time to first token {r.time_to_first_token_s * 1e3:.1f} ms, then {after:.1f} tokens/s")
        if baseline is not None:
            same = "yes" if row["identical_to_baseline"] else "no"
            why = ("" if args.temperature == 0 else " (sampling: lossless means the same distribution as plain "
                   "sampling, not the same tokens)")
            how = " (DFlash streamed: a host round trip per step)" if args.stream else ""
            print(f"--- plain decoding {row['baseline_tokens_per_second']:.1f} tokens/s, DFlash "
                  f"{r.tokens_per_second:.1f} tokens/s: speedup {row['speedup']:.2f}x{how}, identical output: "
                  f"{same}{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
