"""``python -m infer.structured_benchmark``: what a grammar costs (structured outputs, docs/structured-outputs.md).
The same prompts decoded four ways in one run, each run twice and timed the second time (the first compiles): plain and DFlash
decoding, each unconstrained and constrained by a grammar (``--json-schema FILE``, ``--regex R`` or
``--json-object``; default: a small JSON schema). Reported: tokens/s and tau of each, constrained DFlash /
constrained plain, constrained / unconstrained DFlash, whether constrained DFlash equals constrained plain decoding
token for token (greedy), and how many constrained answers match their grammar (JSON parsed, the schema's required
keys present; a regex matched in full).
"""
from __future__ import annotations

import argparse
import json
import re
import sys


from dflash_jax.launch import launch
from dflash_jax.machine import machine, warn_if_busy
from infer.flags import (add_max_batch_arg, add_model_args, decoding_kwargs, die, exits_on_interrupt, fixed_block_size,
                         paging_kwargs, shows_bar)
from infer.loading import load_models
from infer.prompt_input import encode, read_prompts_file

DEFAULT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "tags"],
                  "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                          "maxItems": 3}}}
DEFAULT_PROMPTS = ["def describe(thing):\n    return ", "CONFIG = ", "import json\n\nrecord = ",
                   "class Item:\n    def to_dict(self):\n        return "]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.structured_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("grammar (one; default: a small JSON schema)")
    g.add_argument("--json-schema", help="a JSON schema file every answer must match")
    g.add_argument("--regex", help="a regular expression every answer must match in full")
    g.add_argument("--json-object", action="store_true", help="any JSON object")
    r = p.add_argument_group("run")
    r.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field (default: four code "
                                          "prompts that open a value)")
    r.add_argument("--num-prompts", type=int, default=8, help="prompts decoded (cycled; default 8)")
    r.add_argument("--json", action="store_true", help="one JSON object per way, then a summary object")
    add_max_batch_arg(r)
    return p.parse_args(argv)


def grammar_of(args):
    """(the ``Grammar``, a check of one answer's text) of the flags."""
    from dflash_jax.grammar import Grammar

    given = [f for f in ("json_schema", "regex", "json_object") if getattr(args, f)]
    if len(given) > 1:
        die(f"give one grammar, got --{' --'.join(g.replace('_', '-') for g in given)}")
    if args.regex:
        return Grammar.regex(args.regex), lambda text: re.fullmatch(args.regex, text) is not None
    if args.json_object:
        return Grammar.json_object(), lambda text: isinstance(_json(text), dict)
    schema = DEFAULT_SCHEMA
    if args.json_schema:
        try:
            with open(args.json_schema) as f:
                schema = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            die(f"--json-schema {args.json_schema}: {e}")

    def valid(text):
        value = _json(text)
        return isinstance(value, dict) and all(k in value for k in schema.get("required", ()))

    return Grammar.json_schema(schema), valid


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@exits_on_interrupt
def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    if args.num_prompts < 1:
        die(f"--num-prompts must be >= 1, got {args.num_prompts}")
    grammar, valid = grammar_of(args)
    records = read_prompts_file(args.prompts_file) if args.prompts_file else [{"prompt": p} for p in DEFAULT_PROMPTS]
    records = [records[i % len(records)] for i in range(args.num_prompts)]
    target, draft, tokenizer = load_models(args, records)
    if draft is None or tokenizer is None:
        die("the structured benchmark compares plain and DFlash decoding with a grammar: it needs --draft and a "
            "target with a tokenizer")
    from dflash_jax.decode import Request
    from dflash_jax.progress import progress_bar
    from infer.batching_benchmark import run_way

    prompts = encode(tokenizer, records)
    kw = dict(decoding_kwargs(args, target), block_size=fixed_block_size(args), **paging_kwargs(args))
    slots = args.max_batch or 1
    free = [Request(p, stream=i) for i, p in enumerate(prompts)]
    bound = [Request(p, stream=i, grammar=grammar) for i, p in enumerate(prompts)]
    ways = [("plain", None, free), ("dflash", draft, free), ("plain", None, bound), ("dflash", draft, bound)]
    where = machine()
    warn_if_busy(where)
    results = {}
    bar = progress_bar(len(ways), "structured benchmark", "run", shows_bar(args))
    try:
        for method, d, requests in ways:
            own = dict(kw, block_size=None) if d is None else kw
            for _ in range(2):  # the first compiles the constrained programs (Engine.warm runs unconstrained ones)
                results[(method, requests is bound)] = run_way(target, d, requests, slots, "continuous",
                                                               dict(own, tokenizer=tokenizer))
            bar.update(1)
    except ValueError as e:
        die(str(e))
    finally:
        bar.close()
    texts = [tokenizer.decode(ids[len(p):], skip_special_tokens=True)
             for ids, p in zip(results[("dflash", True)]["outputs"], prompts)]
    tps = {k: r["tokens_per_s"] for k, r in results.items()}
    summary = {"summary": True, "target": target.path, "draft": draft.path, "grammar": grammar.kind,
               "num_prompts": len(prompts), "max_batch": slots, "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature,
               "tau": {"unconstrained": results[("dflash", False)]["tau"],
                       "constrained": results[("dflash", True)]["tau"]},
               "constrained_speedup": tps[("dflash", True)] / tps[("plain", True)],
               "unconstrained_speedup": tps[("dflash", False)] / tps[("plain", False)],
               "constrained_vs_unconstrained": {m: tps[(m, True)] / tps[(m, False)] for m in ("plain", "dflash")},
               "identical": results[("dflash", True)]["outputs"] == results[("plain", True)]["outputs"],
               "valid": int(sum(valid(t) for t in texts)), "machine": where}
    if args.json:
        for (method, constrained), r in results.items():
            print(json.dumps({"method": method, "constrained": constrained,
                              **{k: v for k, v in r.items() if k != "outputs"}}))
        print(json.dumps(summary))
        return 0
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens at most, {slots} slots, grammar "
          f"{grammar.kind}")
    print(f"{'method':>7} {'grammar':>8} {'tokens/s':>9} {'tau':>5}")
    for (method, constrained), r in results.items():
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        print(f"{method:>7} {'yes' if constrained else 'no':>8} {r['tokens_per_s']:>9.1f} {tau:>5}")
    cu = summary["constrained_vs_unconstrained"]
    print(f"DFlash / plain: constrained {summary['constrained_speedup']:.2f}x, unconstrained "
          f"{summary['unconstrained_speedup']:.2f}x; constrained / unconstrained: plain {cu['plain']:.2f}x, DFlash "
          f"{cu['dflash']:.2f}x; constrained DFlash identical to constrained plain: {summary['identical']}; "
          f"answers matching the grammar: {summary['valid']} / {len(texts)}")
    print(f"measured on {where['device']} ({where['backend']}), {where['cpu_count']} CPUs, load average "
          f"{where['load_average'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
