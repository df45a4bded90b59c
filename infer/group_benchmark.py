"""Sample groups with and without prefix caching: ``python -m infer.group_benchmark [--target T --draft D]
[--num-prompts 32] [--group 8]``.

A GRPO-shaped workload: every prompt sampled ``--group`` times (``Request.group``: its own key stream per sample,
temperature 1 by default) through the continuous-batching engine, run twice in this process on the same requests:
with prefix caching (each group's prompt prefilled once, the other samples sharing its pages) and without (every
sample an independent request, prefilled whole). Reported for both: output tokens/s, the wall time spent in
admissions (prefills, waited for), the prompt tokens read from cache, and whether both runs drew the same tokens
(they must: a hit changes no draw). Compiled before the clock starts; the machine's load average beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from dflash_jax.launch import launch
from infer.flags import add_model_args, decoding_kwargs, die, fixed_block_size
from infer.loading import load_models
from infer.prompt_input import read_prompts_file


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.group_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("groups")
    g.add_argument("--num-prompts", type=int, default=32, help="prompts (default 32)")
    g.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    g.add_argument("--max-batch", type=int, default=64, help="rows in flight (default 64)")
    g.add_argument("--prompts-file", default=None, help="text prompts (default: the demo's held-out prompts)")
    g.add_argument("--json", action="store_true", help="one JSON object per run, then a summary")
    p.set_defaults(max_new_tokens=64, temperature=1.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    if args.num_prompts < 1 or args.group < 1 or args.max_batch < 1:
        die("--num-prompts, --group and --max-batch must be >= 1")
    from dflash_jax.decode import RunStats, Request, continuous_generate
    from dflash_jax.prompts import encode_prompt
    from infer.benchmark import default_prompts

    texts = ([r["prompt"] for r in read_prompts_file(args.prompts_file)] if args.prompts_file
             else default_prompts(args.num_prompts))[:args.num_prompts]
    target, draft, tokenizer = load_models(args)
    if tokenizer is None:
        die("the group benchmark encodes text prompts: the target needs a tokenizer")
    requests = [r for i, t in enumerate(texts)
                for r in Request(encode_prompt({"prompt": t}, tokenizer), stream=i).group(args.group)]
    kw = dict(decoding_kwargs(args, target), max_batch=args.max_batch, block_size=fixed_block_size(args))
    load, runs = os.getloadavg(), {}
    for name, on in (("shared", True), ("independent", False)):
        stats = RunStats()
        results = continuous_generate(target, draft, requests, stats=stats, prefix_cache=on, **kw)
        tokens = sum(r.num_generated for r in results)
        runs[name] = {"run": name, "requests": len(requests), "output_tokens": tokens,
                      "tokens_per_s": tokens / stats.wall_time_s, "admit_time_s": stats.admit_time_s,
                      "wall_time_s": stats.wall_time_s, "cached_tokens": sum(r.cached_tokens for r in results),
                      "outputs": [r.generated_ids for r in results]}
        print(f"  {name}: {runs[name]['tokens_per_s']:.1f} tokens/s, admissions {stats.admit_time_s:.2f} s",
              file=sys.stderr)
    same = runs["shared"].pop("outputs") == runs["independent"].pop("outputs")
    summary = {"speedup": runs["shared"]["tokens_per_s"] / runs["independent"]["tokens_per_s"],
               "admit_time_ratio": runs["shared"]["admit_time_s"] / max(runs["independent"]["admit_time_s"], 1e-9),
               "identical": same, "load_average_start": load, "load_average_end": os.getloadavg()}
    if args.json:
        for r in runs.values():
            print(json.dumps(r))
        print(json.dumps(summary))
        return 0
    print("| run | requests | output tok/s | admissions (s) | wall (s) | cached prompt tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs.values():
        print(f"| {r['run']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['admit_time_s']:.2f} | "
              f"{r['wall_time_s']:.2f} | {r['cached_tokens']} |")
    print(f"shared / independent: {summary['speedup']:.2f}x tokens/s, {summary['admit_time_ratio']:.2f}x admission "
          f"time; identical draws: {'yes' if same else 'NO'}; load average {load[0]:.2f} at the start, "
          f"{summary['load_average_end'][0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
