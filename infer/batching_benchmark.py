"""``python -m infer.benchmark --max-batch S``: a mixed workload decoded three ways in one run (continuous
batching through S slots, static batches of S, one prompt at a time), each with plain and DFlash decoding.

Each request has its own budget (a prompts-file row's ``max_new_tokens``, or ``--mixed-budgets LO,HI``: drawn
uniformly per request with a fixed seed), so a static batch waits on its longest row while continuous batching
gives a finished row's slot to the next request at once. All six share one engine per method (the same compiled
programs: static batches are the engine's ``static`` policy, one at a time is S = 1), each warmed before it is
timed. Reported per way and method: tokens/s (every generated token over the run's wall time), mean and p90 time
per request (from the run's start until the request's last token: queueing included), slot occupancy; then
continuous / static and continuous / one-at-a-time, DFlash / plain, and whether all six outputs are identical.

``--kv-cache-memory M`` pages every run in a pool of M and adds a fourth way, ``slots``: continuous batching with
unpaged caches (``--page-size 0``) through as many max-length rows as M holds. Continuous vs slots at one memory
budget is what paging buys: rows in flight (mean occupancy x rows) and tokens/s.
"""
from __future__ import annotations

import json

import numpy as np

from dflash_jax.decode.memory import param_dtype, row_cache_bytes
from infer.flags import die, paging_kwargs, shows_bar

WAYS = (("continuous", "continuous"), ("static", "static"), ("one_at_a_time", "continuous"))


def requests_with_budgets(args, prompts, overrides) -> list:
    """The workload: a request per prompt, its budget from its row, from ``--mixed-budgets``, or the default."""
    from infer.prompt_input import requests_of

    if args.mixed_budgets:
        try:
            lo, hi = (int(x) for x in args.mixed_budgets.split(","))
        except ValueError:
            lo = hi = 0
        if not 1 <= lo <= hi:
            die(f"--mixed-budgets takes LO,HI with 1 <= LO <= HI, got {args.mixed_budgets!r}")
        rng = np.random.default_rng(0)
        overrides = [dict(o, max_new_tokens=o.get("max_new_tokens", int(rng.integers(lo, hi + 1))))
                     for o in overrides]
    return requests_of(prompts, overrides)


def run_way(target, draft, requests, slots: int, policy: str, kw: dict) -> dict:
    """One way of one method, timed after a warm-up -> its figures and outputs (``kw``: decoding and paging)."""
    from dflash_jax.decode import RunStats, continuous_generate

    stats = RunStats()
    out = continuous_generate(target, draft, requests, max_batch=slots, stats=stats, policy=policy, **kw)
    latency = np.array([r.queue_time_s + r.wall_time_s for r in out])
    tokens = sum(r.num_generated for r in out)
    acc = [a for r in out for a in r.acceptance_lengths]
    return {"slots": stats.slots, "policy": policy, "tokens": tokens, "wall_time_s": stats.wall_time_s,
            "tokens_per_s": tokens / stats.wall_time_s, "mean_request_s": float(latency.mean()),
            "p90_request_s": float(np.percentile(latency, 90)), "occupancy": stats.occupancy,
            "loop_steps": stats.loop_steps, "programs": stats.programs, "rows_in_flight": stats.occupancy * slots,
            "preemptions": stats.preemptions,
            "tau": float(np.mean(acc)) if acc else None, "outputs": [r.output_ids for r in out]}


def slots_in(memory: int, target, draft, requests, budgets, opts: dict) -> int:
    """Unpaged rows whose caches (the longest request's length, as ``continuous_generate`` sizes them) fit
    ``memory`` bytes: at least one."""
    from dflash_jax.decode import DecodeOptions, cache_length

    max_block = DecodeOptions(**opts).max_block(draft)
    cache_len = cache_length([len(r.prompt_ids) for r in requests], budgets, max_block)
    per_row = row_cache_bytes(target.config, draft and draft.config, cache_len, param_dtype(target), max_block)
    return max(1, memory // per_row)


def run(args, target, draft, prompts, overrides, *, kw: dict, spec_kw: dict, where: dict) -> int:
    """The comparison (module docstring; ``kw`` plain decoding's options, ``spec_kw`` DFlash's extra ones); prints
    one row per way and method, then the summary (``--json``)."""
    from dflash_jax.progress import progress_bar

    requests = requests_with_budgets(args, prompts, overrides)
    budgets = [r.max_new_tokens or kw["max_new_tokens"] for r in requests]
    slots = args.max_batch
    paging = paging_kwargs(args)
    ways = WAYS + ((("slots", "continuous"),) if "kv_cache_memory" in paging else ())
    results, bar = {}, progress_bar(2 * len(ways), "batching benchmark", "run", shows_bar(args))
    try:
        for method, d, opts in (("plain", None, kw), ("dflash", draft, dict(kw, **spec_kw))):
            for way, policy in ways:
                rows, own = 1 if way == "one_at_a_time" else slots, dict(opts, **paging)
                if way == "slots":  # unpaged rows of the max length in the same memory
                    rows, own = slots_in(paging["kv_cache_memory"], target, d, requests, budgets, opts), dict(opts, page=0)
                results[(way, method)] = run_way(target, d, requests, rows, policy, own)
                bar.update(1)
    except ValueError as e:
        die(str(e))
    finally:
        bar.close()
    reference = results[("continuous", "plain")]["outputs"]
    identical = all(r["outputs"] == reference for r in results.values())
    rows = [{"way": way, "method": method, **{k: v for k, v in r.items() if k != "outputs"}}
            for (way, method), r in results.items()]
    tps = {(w, m): r["tokens_per_s"] for (w, m), r in results.items()}
    summary = {"summary": True, "target": target.path, "draft": draft.path, "num_prompts": len(requests),
               "max_batch": slots, "budgets": {"min": min(budgets), "max": max(budgets),
                                                "mean": float(np.mean(budgets))},
               "block_size": spec_kw.get("block_size") or draft.config.block_size, "temperature": args.temperature,
               "tau": results[("continuous", "dflash")]["tau"],
               "speedup": tps[("continuous", "dflash")] / tps[("continuous", "plain")],
               "continuous_vs_static": {m: tps[("continuous", m)] / tps[("static", m)] for m in ("plain", "dflash")},
               "continuous_vs_one_at_a_time": {m: tps[("continuous", m)] / tps[("one_at_a_time", m)]
                                               for m in ("plain", "dflash")},
               "identical": identical, "machine": where}
    if ("slots", "dflash") in results:  # one memory budget, paged vs unpaged rows
        summary["paged_vs_slots"] = {m: {"tokens_per_s": tps[("continuous", m)] / tps[("slots", m)],
                                         "rows_in_flight": [results[(w, m)]["rows_in_flight"]
                                                            for w in ("continuous", "slots")]}
                                     for m in ("plain", "dflash")}
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(summary))
        return 0
    print(f"{len(requests)} requests, budgets {min(budgets)}-{max(budgets)} (mean {np.mean(budgets):.0f}), "
          f"{slots} slots")
    print(f"{'way':>14} {'method':>7} {'tokens/s':>9} {'mean req s':>10} {'p90 req s':>9} {'occupancy':>9} "
          f"{'tau':>5} {'rows':>5}")
    for r in rows:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        print(f"{r['way']:>14} {r['method']:>7} {r['tokens_per_s']:>9.1f} {r['mean_request_s']:>10.2f} "
              f"{r['p90_request_s']:>9.2f} {r['occupancy']:>9.2f} {tau:>5} {r['slots']:>5}")
    cs = summary["continuous_vs_static"]
    print(f"continuous / static: plain {cs['plain']:.2f}x, DFlash {cs['dflash']:.2f}x; DFlash / plain (continuous) "
          f"{summary['speedup']:.2f}x; identical outputs (all {len(results)}): {identical}")
    for m, r in summary.get("paged_vs_slots", {}).items():
        print(f"paged vs slots ({m}, one memory budget): {r['tokens_per_s']:.2f}x tokens/s, rows in flight "
              f"{r['rows_in_flight'][0]:.1f} vs {r['rows_in_flight'][1]:.1f}")
    print(f"measured on {where['device']} ({where['backend']}), {where['cpu_count']} CPUs, load average "
          f"{where['load_average'][0]}")
    return 0
