"""Plain vs DFlash decoding side by side: ``python -m infer.benchmark [--target T --draft D] ...``.

Both run in this process on the same prompts (batch 1, as in the paper) with the same
max_new_tokens, compiled before timing. Each prompt runs once per method untimed (the first execution
of a compiled shape has one-time setup costs), then ``--repeats`` times per method, alternating; the
fastest run of each counts (as timeit does: on a shared machine, interference only adds time).
Reports mean acceptance length tau, its histogram, the acceptance rate per block position, tokens/s
of both, the speedup, whether every output was identical (greedy: for each prompt whose output differs,
the first differing token and the target's top-2 logit gap there, so a near-tie flipped by low-precision
rounding looks different from a bug), how repetitive the outputs are (distinct 4-grams), and the time of
one draft and one verify forward. ``--json`` prints one row per prompt,
then one summary object. With ``--verify-lengths`` (adaptive verify) DFlash runs with it and the fixed
block runs beside it as a third method: the chosen-length histogram, tokens verified per step, the fixed
block's tokens/s and adaptive / fixed. With ``--tree-budget N`` DFlash runs with tree verification and the
chain runs beside it: the summary's ``tau`` is the tree's, plus ``tree_budget``, ``verified_tokens_per_step``
(N + 1), ``chain_tau``, ``tree_vs_chain_tau``, ``chain_tokens_per_s``, ``tree_vs_chain_speed`` and both
acceptance-depth histograms.

``--max-batch S`` instead compares continuous batching through S slots with static batches of S and one prompt at
a time, plain and DFlash, on a workload of per-request budgets (``--mixed-budgets LO,HI`` or the prompts file's
``max_new_tokens``): see ``infer/batching_benchmark.py``.

``--dataset NAME`` takes the prompts from an evaluation set of the paper (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench,
Alpaca) through the target's chat template, as the paper's benchmark builds them: see ``infer/bench_sets.py``.

``--synthetic NAME`` benchmarks a preset at real model shapes (Qwen3-4B / 8B, LLaMA-3.1-8B, a tiny CPU one)
with random weights and a SIMULATED acceptance length (``--replay-tau`` / ``--replay-histogram``), per
``--batch-size`` and ``--context``: see ``infer/synthetic_benchmark.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import numpy as np

from dflash_jax.machine import machine, warn_if_busy
from dflash_jax.progress import progress_bar
from dflash_jax.launch import launch
from infer import bench_sets
from infer import synthetic_benchmark
from infer.timing import fastest, first_mismatch, step_split, time_forwards
from dflash_jax.demo import DEMO_TARGET
from infer.flags import (adaptive_kwargs, add_model_args, decoding_kwargs, die, draft_kwargs, exits_on_interrupt,
                         memory_arg, resolve_block, shows_bar)
from infer.loading import load_models
from infer.prompt_input import check_overrides, encode, read_prompts_file


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts-file", help="JSONL with a 'prompt' (text) or 'prompt_ids' field per line, or plain "
                                          "text one per line (\\n = newline) (default: code prompts cut from the "
                                          "demo's held-out stdlib modules)")
    p.add_argument("--dataset", help="an evaluation set of the DFlash paper and DeepSpec: "
                                     f"{', '.join(bench_sets.SETS)}, read with the datasets library from its cache "
                                     "(HF_DATASETS_OFFLINE honoured), each row as one user turn in the target's chat "
                                     "template (infer/bench_sets.py; needs dflash_jax[bench])")
    p.add_argument("--dataset-path", help="with --dataset: a local copy of the set (a directory laid out as its "
                                          "Hugging Face repository) read in place of the hub id")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="number of default prompts, or of --dataset's rows (its first N) (default 16)")
    p.add_argument("--json", action="store_true", help="per-prompt rows, then one summary object")
    p.add_argument("--plot", help="write a PNG report: tau per prompt, acceptance per block position, tokens/s and "
                                  "speedup, titled with target, draft, block and device (needs matplotlib)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per prompt and method, alternating, after one untimed warm-up run; "
                        "the fastest counts (default 3)")
    p.add_argument("--no-timing-split", action="store_true", help="skip timing single draft / verify forwards")
    b = p.add_argument_group("batching (continuous vs static vs one at a time: infer/batching_benchmark.py)")
    b.add_argument("--max-batch", type=int, default=None,
                   help="run the batching comparison with S slots (instead of the per-prompt batch-1 benchmark)")
    b.add_argument("--kv-cache-memory", type=memory_arg, default=None,
                   help="the paged engine's cache pool (bytes, or a fraction of the free device memory): the "
                        "continuous run pages in it, and a 'slots' run beside it holds as many max-length rows as "
                        "the same memory fits (the engine with --page-size 0)")
    b.add_argument("--mixed-budgets", default=None,
                   help="LO,HI: each request's max_new_tokens drawn uniformly from [LO, HI] (fixed seed), where its "
                        "prompts-file row sets none (default: --max-new-tokens for all)")
    synthetic_benchmark.add_args(p)
    p.set_defaults(max_new_tokens=128)
    return p.parse_args(argv)


def default_prompts(n: int) -> list[str]:
    from dflash_jax.demo.corpus import code_prompts, heldout_files

    return code_prompts(heldout_files(), n, seed=1234)


def prompt_records(args) -> list[dict]:
    """The prompts of the run, read before any model loads: ``--prompts-file``, ``--dataset``'s first
    ``--num-prompts`` rows, or the demo's code prompts for the demo target."""
    if args.dataset:
        try:
            return bench_sets.records(args.dataset, args.num_prompts, args.dataset_path)
        except bench_sets.BenchSetError as e:
            die(str(e))
    if args.dataset_path:
        die("--dataset-path needs --dataset NAME (the set it holds)")
    if args.prompts_file:
        return read_prompts_file(args.prompts_file)
    if args.target is None or args.target == DEMO_TARGET:
        return [{"prompt": t} for t in default_prompts(args.num_prompts)]
    die("pass --prompts-file (the default prompts are stdlib code for the demo target)")


def check_plot_path(path: str | None) -> None:
    """``--plot``: matplotlib importable and the file's folder there, before the benchmark runs."""
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        die("--plot needs matplotlib: pip install 'dflash_jax[plot]'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        die(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        die(f"--plot {path}: the folder {folder} is not writable")


def distinct_4grams(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def plot(summary: dict, rows: list[dict], path: str | None = None):
    """The report figure: tau per prompt, acceptance rate per block position, tokens/s of both methods with the
    speedup; titled with target, draft, block size and device. Saved to ``path`` (or returned to show)."""
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    prompts = [r["index"] for r in rows]
    a.bar(prompts, [r["tau"] for r in rows], color="tab:blue")
    a.axhline(summary["tau"], color="k", ls="--", lw=1, label=f"mean tau {summary['tau']:.2f}")
    a.set(xlabel="prompt", ylabel="tau (tokens per target forward)", xticks=prompts, title="acceptance length")
    a.legend()
    rates = [np.nan if r is None else r for r in summary["acceptance_rate_per_position"]]
    b.plot(range(1, len(rates) + 1), rates, marker="o")
    b.set(xlabel="draft position k", ylabel="P(draft token k accepted)", ylim=(0, 1.02),
          xticks=range(1, len(rates) + 1), title="acceptance per block position")
    c.bar(["plain", "DFlash"], [summary["plain_tokens_per_s"], summary["dflash_tokens_per_s"]],
          color=["tab:gray", "tab:green"])
    c.set(ylabel="tokens / s", title=f"speedup {summary['speedup']:.2f}x (identical: {summary['identical']})")
    m = summary["machine"]
    name = lambda p: "/".join(os.path.normpath(str(p)).split(os.sep)[-2:])  # noqa: E731  (e.g. demo/target)
    fig.suptitle(f"target {name(summary['target'])} | draft {name(summary['draft'])} | block {summary['block_size']} | "
                 f"{m['device']} ({m['backend']}), load {m['load_average'][0]}")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


@dataclasses.dataclass
class _Run:
    """What every part of one benchmark run reads: the options, the models, the prompts and the block."""

    args: argparse.Namespace
    target: object
    draft: object
    prompts: list
    block: int
    choice: object  # auto_block.Choice (--block-size auto) or None
    adaptive: dict
    tree: dict
    where: dict  # machine()


class _Totals:
    """The per-method sums over the prompts: wall time, tokens, acceptance and verify lengths."""

    def __init__(self):
        self.plain_time = self.spec_time = self.fixed_time = 0.0
        self.plain_tokens = self.spec_tokens = self.fixed_tokens = 0
        self.acc, self.verified, self.chain_acc = [], [], []


def measure(run: _Run, methods: list) -> tuple[list[dict], _Totals]:
    """Every prompt through every method (``fastest`` of --repeats, alternating): one row per prompt + totals."""
    args, target = run.args, run.target
    t, rows = _Totals(), []
    bar = progress_bar(len(run.prompts), "benchmark", "prompt", shows_bar(args))
    try:
        for i, p in enumerate(run.prompts):
            base, spec, *fixed = fastest(args.repeats, *(functools.partial(m, p) for m in methods))
            t.plain_time += base.wall_time_s
            t.spec_time += spec.wall_time_s
            t.plain_tokens += base.num_generated
            t.spec_tokens += spec.num_generated
            t.acc += spec.acceptance_lengths
            t.verified += spec.verify_lengths
            rows.append({"index": i, "prompt_tokens": len(p), "tau": spec.mean_acceptance_length,
                         "num_generated": spec.num_generated, "plain_tokens_per_s": base.tokens_per_second,
                         "dflash_tokens_per_s": spec.tokens_per_second,
                         "speedup": spec.tokens_per_second / base.tokens_per_second,
                         "identical": spec.output_ids == base.output_ids,
                         "distinct_4grams": distinct_4grams(spec.generated_ids),
                         "acceptance_lengths": spec.acceptance_lengths,
                         # greedy only: sampled outputs differ by design (the two methods draw differently)
                         "first_mismatch": first_mismatch(target, base, spec) if args.temperature == 0 else None})
            if fixed:
                t.fixed_time += fixed[0].wall_time_s
                t.fixed_tokens += fixed[0].num_generated
                t.chain_acc += fixed[0].acceptance_lengths
                rows[-1].update(verify_lengths=spec.verify_lengths,
                                fixed_block_tokens_per_s=fixed[0].tokens_per_second,
                                fixed_block_identical=fixed[0].output_ids == base.output_ids)
            bar.update(1)
    except ValueError as e:
        die(str(e))
    finally:
        bar.close()
    return rows, t


def summarize(run: _Run, rows: list[dict], t: _Totals) -> dict:
    """The summary object: tau, histograms, speeds, speedup, identity, and the adaptive / tree / timing parts."""
    from dflash_jax.decode.memory import param_dtype

    args, block, tree = run.args, run.block, run.tree
    acc = np.array(t.acc)
    k = run.draft.config.verify_length(block)  # tokens a step verifies (a DSpark block of B slots verifies B + 1)
    hist = np.bincount(acc, minlength=k + 1)[1:k + 1]
    # draft token k accepted, among the steps that verified it (adaptive verify may stop before position k; a
    # tree reaches every depth up to min(N, k - 1))
    ver = np.full(len(acc), min(args.tree_budget, k - 1) + 1) if tree else np.array(t.verified)
    per_position = [float((acc[ver > j] > j).mean()) if (ver > j).any() else None for j in range(1, k)]
    plain_tps, spec_tps = t.plain_tokens / t.plain_time, t.spec_tokens / t.spec_time
    tau = float(acc.mean())
    summary = {"summary": True, "target": run.target.path, "draft": run.draft.path, "block_size": block,
               "block_choice": run.choice.to_json() if run.choice is not None else None,
               "num_prompts": len(run.prompts), "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature, "tau": tau, "acceptance_histogram": hist.tolist(),
               "acceptance_rate_per_position": per_position,
               "plain_tokens_per_s": plain_tps, "dflash_tokens_per_s": spec_tps, "speedup": spec_tps / plain_tps,
               "engine_efficiency": spec_tps / plain_tps / tau,
               "identical": all(r["identical"] for r in rows),
               "num_identical": sum(r["identical"] for r in rows),
               "distinct_4grams": float(np.mean([r["distinct_4grams"] for r in rows])), "machine": run.where,
               "dtype": param_dtype(run.target)}
    if run.adaptive:
        lengths, counts = np.unique(t.verified, return_counts=True)
        summary.update(verify_lengths=sorted(set(run.adaptive["verify_lengths"])),
                       verify_threshold=args.verify_threshold,
                       verify_length_histogram={int(k): int(c) for k, c in zip(lengths, counts)},
                       verified_tokens_per_step=float(np.mean(t.verified)),
                       fixed_block_tokens_per_s=t.fixed_tokens / t.fixed_time,
                       adaptive_vs_fixed=spec_tps * t.fixed_time / t.fixed_tokens)
    if tree:  # the chain's figures from the same run
        chain_tau, chain_tps = float(np.mean(t.chain_acc)), t.fixed_tokens / t.fixed_time
        summary.update(tree_budget=args.tree_budget, verified_tokens_per_step=float(np.mean(t.verified)),
                       chain_tau=chain_tau, tree_vs_chain_tau=tau / chain_tau, chain_tokens_per_s=chain_tps,
                       tree_vs_chain_speed=spec_tps / chain_tps,
                       chain_acceptance_histogram=np.bincount(t.chain_acc, minlength=k + 1)[1:k + 1].tolist())
    # wall time per target forward of each method, prefill included (plain: one per token)
    summary["plain_step_s"] = t.plain_time / t.plain_tokens
    summary["dflash_step_s"] = t.spec_time / (len(t.acc) + len(run.prompts))
    if not args.no_timing_split:
        timings = time_forwards(run.target, run.draft, block_sizes=sorted({4, 8, 16, k}),  # k: tokens verified
                                attention_impl=args.attention, parts_block=k, whole_step=not args.tree_budget)
        summary["step_split_s"] = step_split(timings, k, summary["dflash_step_s"])
        timings.pop("step_parts_s", None)
        timings.pop("step_loop_s", None)
        summary.update(timings)
    return summary


def print_report(args, summary: dict, rows: list[dict]) -> None:
    """The human-readable report (without --json): one line per prompt, then the summary's figures."""
    block = summary["block_size"]
    print(f"{'prompt':>6} {'tokens':>6} {'tau':>6} {'plain t/s':>10} {'DFlash t/s':>10} {'speedup':>8} same")
    for r in rows:
        print(f"{r['index']:>6} {r['num_generated']:>6} {r['tau']:>6.2f} {r['plain_tokens_per_s']:>10.1f} "
              f"{r['dflash_tokens_per_s']:>10.1f} {r['speedup']:>7.2f}x {r['identical']}")
    print(f"\ntau {summary['tau']:.2f} (block {block}), plain {summary['plain_tokens_per_s']:.1f} tokens/s, DFlash "
          f"{summary['dflash_tokens_per_s']:.1f} tokens/s, speedup {summary['speedup']:.2f}x, engine efficiency "
          f"(speedup/tau) {summary['engine_efficiency']:.2f}, identical outputs: {summary['identical']}, distinct "
          f"4-grams {summary['distinct_4grams']:.2f}")
    for r in rows:
        m = r["first_mismatch"]
        if m:
            print(f"prompt {r['index']}: first difference at generated token {m['position']} (plain "
                  f"{m['plain_token']}, DFlash {m['dflash_token']}); the target's top-2 logit gap there "
                  f"{m['top2_logit_gap']:.4g}, DFlash's token {m['dflash_token_gap'] or 0:.4g} below the top "
                  "(near the dtype's rounding: a near-tie; large: a bug)")
    hist = summary["acceptance_histogram"]
    print("acceptance-length histogram:", " ".join(f"{k + 1}:{c}" for k, c in enumerate(hist)))
    if "verify_length_histogram" in summary:
        print(f"adaptive verify (lengths {','.join(map(str, summary['verify_lengths']))}, threshold "
              f"{args.verify_threshold}): verify-length histogram "
              + " ".join(f"{k}:{c}" for k, c in summary["verify_length_histogram"].items())
              + f", {summary['verified_tokens_per_step']:.2f} tokens verified per step"
              + f"; fixed block {block}: {summary['fixed_block_tokens_per_s']:.1f} tokens/s, adaptive / fixed "
                f"{summary['adaptive_vs_fixed']:.2f}x")
    if "tree_budget" in summary:
        print(f"tree verify: {args.tree_budget} nodes, {summary['verified_tokens_per_step']:.0f} tokens verified "
              f"per step; chain (block {block}) in the same run: tau {summary['chain_tau']:.2f}, "
              f"{summary['chain_tokens_per_s']:.1f} tokens/s; tree / chain: tau {summary['tree_vs_chain_tau']:.2f}x, "
              f"speed {summary['tree_vs_chain_speed']:.2f}x")
    print("acceptance rate per block position:",
          " ".join("-" if r is None else f"{r:.2f}" for r in summary["acceptance_rate_per_position"]))
    print(f"one step: plain {summary['plain_step_s'] * 1e3:.2f} ms, DFlash {summary['dflash_step_s'] * 1e3:.2f} ms"
          + ("" if args.no_timing_split else " = " + " + ".join(
              f"{k} {v * 1e3:.2f}" for k, v in summary["step_split_s"].items()) + " ms"))
    for kind in ("draft", "verify"):
        sizes = sorted(int(k.rsplit("block", 1)[1]) for k in summary if k.startswith(f"{kind}_forward_s_block"))
        if sizes:
            print(f"one {kind} forward: " + ", ".join(
                f"block {k} {summary[f'{kind}_forward_s_block{k}'] * 1e3:.2f} ms" for k in sizes))
    m = summary["machine"]
    print(f"measured on {m['device']} ({m['backend']}, {m['num_devices']} device(s)), {m['cpu_count']} CPUs, "
          f"load average {m['load_average'][0]}, {summary['dtype']}")


@exits_on_interrupt
def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    if args.repeats < 1:
        die(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_prompts < 1:
        die(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if (args.dataset or args.dataset_path) and (args.prompts_file or args.synthetic):
        die("--dataset / --dataset-path are the run's prompts: drop "
            + ("--prompts-file" if args.prompts_file else "--synthetic"))
    if args.synthetic:
        return synthetic_benchmark.run(args)
    synthetic_benchmark.check_unused(args)
    from dflash_jax.decode import generate, speculative_generate

    check_plot_path(args.plot)  # every option the command line alone can check, before loading
    records, adaptive, extra = prompt_records(args), adaptive_kwargs(args), draft_kwargs(args)
    tree = {k: v for k, v in extra.items() if k == "tree_budget"}
    cut = {k: v for k, v in extra.items() if k != "tree_budget"}  # a DSpark proposal's confidence cut
    if args.max_batch is None and args.mixed_budgets:
        die("--mixed-budgets needs --max-batch (the batching comparison)")
    if args.max_batch is not None and args.max_batch < 1:
        die(f"--max-batch must be >= 1, got {args.max_batch}")
    from dflash_jax.prompts import OVERRIDES

    overrides = [{k: r[k] for k in OVERRIDES if k in r} for r in records]
    check_overrides(args, overrides)
    target, draft, tokenizer = load_models(args, records)
    if draft is None:
        die("the benchmark compares plain and DFlash decoding: pass --draft")
    prompts = encode(tokenizer, records, chat_kwargs=bench_sets.CHAT_KWARGS if args.dataset else None)
    kw = decoding_kwargs(args, target)
    if args.max_batch is not None:
        from infer import batching_benchmark

        block = args.block_size if args.block_size != "auto" else None
        where = machine()
        warn_if_busy(where)
        return batching_benchmark.run(args, target, draft, prompts, overrides, kw=kw,
                            spec_kw=dict(block_size=block, **adaptive, **extra), where=where)
    block, choice = resolve_block(args, target, draft, prompts[:1], kw)  # probed at batch 1, as the runs below
    block = block or draft.config.block_size
    own = {tuple(p): dict(kw, **o) for p, o in zip(prompts, overrides)}  # a row's own settings over the flags'
    methods = [lambda p: generate(target, [p], **own[tuple(p)])[0],
               lambda p: speculative_generate(target, draft, [p], block_size=block, **own[tuple(p)], **adaptive,
                                              **extra)[0]]
    if adaptive or tree:  # the fixed block (the chain) side by side
        methods.append(lambda p: speculative_generate(target, draft, [p], block_size=block, **own[tuple(p)],
                                                      **cut)[0])
    where = machine()
    warn_if_busy(where)
    run = _Run(args, target, draft, prompts, block, choice, adaptive, tree, where)
    rows, totals = measure(run, methods)
    summary = summarize(run, rows, totals)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(summary))
    else:
        print_report(args, summary, rows)
    if args.plot:
        plot(summary, rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
