"""``python -m infer.benchmark --synthetic NAME``: real model shapes, random weights, SIMULATED acceptance.

The preset's target and draft (``dflash_jax.synthetic.PRESETS``) get random weights drawn on the device(s)
(bfloat16 on TPU / GPU, float32 on CPU unless ``--dtype``). Per configuration (each ``--batch-size`` x each
``--context``; the prompts are random tokens of that length; no stop tokens, so every row generates
``--max-new-tokens``), in one run:

1. plain greedy decoding, which also gives each row's reference continuation;
2. DFlash with the replay draft: the draft forward runs as always, but its tokens are replaced by the
   reference cut at an acceptance length drawn per step and row (``--replay-tau``: a truncated geometric
   with that mean, i.e. every draft token accepted with the same probability r until the first rejection;
   or ``--replay-histogram``: counts per length); its output must equal plain decoding's;
3. prefill alone of both (a run with one new token), so decode-only times can be told apart;
4. one draft forward and one verify forward of B tokens (and of 1 token) at this batch and cache length.

Reported: plain step, DFlash step = draft + verify + rest (its named parts: acceptance, cache writes, commit;
other: the unnamed work of the engine's whole step timed alone, as the forwards are; runs: the DFlash step less
that step alone, what running the steps as the decode does adds), the realised tau, the end-to-end speedup (whole calls, prefill included), the
decode speedup (prefill subtracted from both), the engine efficiency = decode speedup / tau (1.0: a DFlash step
costs no more than a plain one), the limit tau x plain step / (draft + verify) (what these forwards allow with no
other work) and efficiency_vs_limit = decode speedup / that limit, exactly the product of ``step_efficiency``
((draft + verify) / DFlash step: the step's own overhead) and ``lockstep`` (plain steps / (DFlash steps x tau):
a closed batch steps until its slowest row ends, 1 at batch 1; continuous batching, ``decode.Engine``, refills
the rows that end instead). ``--continuous-requests N`` measures that too: N requests through the batch's slots,
plain and replayed DFlash, every admission (prefill) timed and left out, against the same limit.
"""
from __future__ import annotations

import json
import sys
import types

import numpy as np

from dflash_jax.progress import progress_bar
from infer.flags import die, fixed_block_size, parse_ints, shows_bar
from infer.timing import fastest, first_mismatch, step_split, time_forwards

TOLERANT_DTYPES = ("bfloat16", "float16")  # a near-tie may flip between block and one-token forwards
# float32: a target top-2 logit gap at or below this is a tie to rounding (a block forward and a one-token forward
# round differently; random logits over a 152k vocabulary tie to the last bit somewhere in a long run: measured, a
# gap of exactly 0 at one of 6144 tokens of a 128-request qwen3-0.6b run)
FLOAT32_TIE = 1e-4


def near_tie(gap: float, dtype: str) -> bool:
    """Whether a greedy mismatch whose target top-2 logit gap (``timing.first_mismatch``) is ``gap`` can be rounding
    rather than a bug: any gap in a low precision (``TOLERANT_DTYPES``), a gap <= ``FLOAT32_TIE`` in float32."""
    return dtype in TOLERANT_DTYPES or gap <= FLOAT32_TIE


def _report_mismatch(msg: str, gap: float, target) -> None:
    """A replayed output that differs from plain decoding: a warning at a near-tie (in ``target``'s dtype), else an
    error and exit 1."""
    import jax

    if not near_tie(gap, str(jax.tree_util.tree_leaves(target.params)[0].dtype)):
        print(f"error: {msg}: a bug (the choice was clear, not a near-tie)", file=sys.stderr)
        raise SystemExit(1)
    print(f"warning: {msg}: a near-tie flipped by rounding (a block forward and a one-token forward round "
          "differently); the replay is off its reference after that, so tau drops", file=sys.stderr)


def add_args(p) -> None:
    g = p.add_argument_group("synthetic benchmark (--synthetic)")
    g.add_argument("--synthetic", metavar="NAME",
                   help="benchmark a preset with random weights and simulated acceptance instead of --target/--draft: "
                        "tiny (CPU-sized); qwen3-0.6b, qwen3-1.7b (real shapes a CPU runs), qwen3-4b, "
                        "qwen3-8b, llama3.1-8b (real shapes and their released drafts')")
    g.add_argument("--replay-tau", type=float, default=None,
                   help="with --synthetic: mean acceptance length to replay (truncated geometric: each draft token "
                        "accepted with the same probability; default 6.5, the paper's Qwen3-8B average)")
    g.add_argument("--replay-histogram", metavar="FILE",
                   help="with --synthetic: replay acceptance lengths drawn from counts per length 1..B (a JSON list, "
                        "the benchmark's summary line, or numbers)")
    g.add_argument("--batch-size", help="with --synthetic: rows per run, comma-separated for several "
                                                     "(e.g. 1,8; default 1)")
    g.add_argument("--context", help="with --synthetic: prompt tokens (random), comma-separated for "
                                                     "several (e.g. 1024,8192; default 1024)")
    g.add_argument("--continuous-requests", type=int, metavar="N",
                   help="with --synthetic: also stream N requests (random prompts of --context tokens) through "
                        "--batch-size slots of the continuous-batching engine (decode.Engine), plain and replayed "
                        "DFlash, and report its decode speedup against the same limit (no lockstep: a row that "
                        "ends is refilled; default: closed batches only)")


def check_unused(args) -> None:
    """The synthetic-only options are an error without --synthetic."""
    given = [f for f, v in (("--replay-tau", args.replay_tau), ("--replay-histogram", args.replay_histogram),
                            ("--batch-size", args.batch_size), ("--context", args.context),
                            ("--continuous-requests", args.continuous_requests)) if v is not None]
    if given:
        die(f"{', '.join(given)} only apply to the synthetic benchmark: add --synthetic NAME")


def replay_distribution(args, block: int) -> tuple[np.ndarray, dict]:
    """(P(acceptance length = 1..block), its description for the report)."""
    from dflash_jax import synthetic as syn

    if args.replay_histogram and args.replay_tau is not None:
        die("pass --replay-tau or --replay-histogram, not both")
    try:
        if args.replay_histogram:
            probs = syn.histogram_probs(syn.read_histogram(args.replay_histogram), block)
            desc = {"distribution": "histogram", "file": args.replay_histogram}
        else:
            tau = min(6.5, block) if args.replay_tau is None else args.replay_tau
            probs = syn.geometric_probs(tau, block)
            desc = {"distribution": "truncated geometric"}
    except (OSError, ValueError) as e:
        die(str(e))
    desc.update(requested_tau=syn.probs_mean(probs), probs=[round(float(x), 6) for x in probs])
    return probs, desc


def _call(fn, *a, **kw):
    """One batched call as ``timing.fastest`` compares runs: all rows' output ids and the call's wall time."""
    def call():
        rows = fn(*a, **kw)
        return types.SimpleNamespace(rows=rows, output_ids=[r.output_ids for r in rows], wall_time_s=rows[0].wall_time_s)

    return call


def stages(args) -> int:
    """The progress bar's parts per configuration: the reference, the timed closed runs, prefill alone, the timed
    forwards, and with ``--continuous-requests N`` every request of each continuous run (plain and DFlash, per
    repeat)."""
    timed = 0 if args.no_timing_split else 1
    return 3 + timed + 2 * args.repeats * (args.continuous_requests or 0)


def measure(target, draft, probs, args, *, batch: int, context: int, block: int, bar) -> dict:
    """One configuration: plain, replayed DFlash, prefill alone of both, and the forward timings; ``bar`` advances
    by ``stages(args)`` parts."""
    from dflash_jax.decode import cache_length, generate, speculative_generate
    from dflash_jax.synthetic import ReplayProposer

    def stage(name: str) -> None:  # the bar names the part about to run
        bar.set_postfix_str(f"batch {batch}, context {context}: {name}", refresh=True)

    rng = np.random.default_rng([args.seed, batch, context])
    prompts = rng.integers(0, target.config.vocab_size, (batch, context)).tolist()
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[], max_length=args.max_length,
              attention_impl=args.attention)
    stage("plain (the reference)")
    plain = generate(target, prompts, **kw)  # the reference continuations (also compiles)
    bar.update(1)
    replay = ReplayProposer(reference=[r.output_ids for r in plain], probs=probs)
    one = dict(kw, max_new_tokens=1)
    try:
        stage("plain and DFlash, timed")
        base, spec = fastest(args.repeats, _call(generate, target, prompts, **kw),
                              _call(speculative_generate, target, draft, prompts, block_size=block, proposer=replay, **kw))
        bar.update(1)
        stage("prefill alone")
        pre_plain, pre_spec = fastest(args.repeats, _call(generate, target, prompts, **one),
                                       _call(speculative_generate, target, draft, prompts, block_size=block, **one))
        bar.update(1)
    except ValueError as e:
        die(str(e))
    base, spec, pre_plain, pre_spec = base.rows, spec.rows, pre_plain.rows, pre_spec.rows
    identical = [b.output_ids == s.output_ids for b, s in zip(base, spec)]
    mismatch = None
    if not all(identical):
        i = identical.index(False)
        mismatch = dict(first_mismatch(target, base[i], spec[i]), row=i)
        msg = (f"batch {batch}, context {context}: replayed DFlash output differs from plain decoding in "
               f"{identical.count(False)} row(s); first at row {i}, generated token {mismatch['position']} "
               f"(target's top-2 logit gap {mismatch['top2_logit_gap']:.4g})")
        _report_mismatch(msg, mismatch["top2_logit_gap"], target)
    wall_plain, wall_spec = base[0].wall_time_s, spec[0].wall_time_s
    prefill_plain, prefill_spec = pre_plain[0].wall_time_s, pre_spec[0].wall_time_s
    acc = np.array([a for r in spec for a in r.acceptance_lengths])
    tau = float(acc.mean())
    plain_steps = max(r.num_generated for r in base) - 1  # the first token comes from the prefill
    spec_steps = max(r.target_forwards for r in spec) - 1
    tokens = sum(r.num_generated for r in base)
    row = {"synthetic": args.synthetic, "acceptance": "simulated", "attention": args.attention, "batch_size": batch,
           "context": context, "block_size": block, "max_new_tokens": args.max_new_tokens, "tau": tau,
           "acceptance_histogram": np.bincount(acc, minlength=block + 1)[1:block + 1].tolist(),
           "plain_loop_steps": plain_steps, "dflash_loop_steps": spec_steps,
           "plain_tokens_per_s": tokens / wall_plain, "dflash_tokens_per_s": tokens / wall_spec,
           "speedup": wall_plain / wall_spec,
           "prefill_s": {"plain": prefill_plain, "dflash": prefill_spec},
           "plain_step_s": max(wall_plain - prefill_plain, 0.0) / max(plain_steps, 1),
           "dflash_step_s": max(wall_spec - prefill_spec, 0.0) / max(spec_steps, 1),
           "identical": all(identical), "first_mismatch": mismatch}
    row["decode_speedup"] = (wall_plain - prefill_plain) / max(wall_spec - prefill_spec, 1e-12)
    row["engine_efficiency"] = row["decode_speedup"] / tau
    if not args.no_timing_split:
        lens = np.full(batch, context)
        limit = args.max_length or target.config.max_position_embeddings
        cache_len = cache_length(lens, np.minimum(args.max_new_tokens, limit - lens), block)
        stage("forwards and step parts, each in a timed loop")
        timings = time_forwards(target, draft, block_sizes=(block,), context=context, batch=batch,
                                cache_len=cache_len, attention_impl=args.attention, parts_block=block,
                                whole_step=True)
        bar.update(1)
        row["step_split_s"] = step_split(timings, block, row["dflash_step_s"])
        timings.pop("step_parts_s")
        timings.pop("step_loop_s")
        row.update(timings)
        # the most a step of these forwards can gain: tau tokens for draft + verify, against tau plain steps
        d, v = row["step_split_s"]["draft"], row["step_split_s"]["verify"]
        row["speedup_limit"] = tau * row["plain_step_s"] / (d + v)
        row["efficiency_vs_limit"] = row["decode_speedup"] / row["speedup_limit"]
        # its two factors, exactly (efficiency_vs_limit = lockstep x step_efficiency): the forwards' share of a step,
        # and the closed batch's lockstep (it steps until its slowest row ends: tokens per row-step / tau, 1 alone)
        row["step_efficiency"] = (d + v) / row["dflash_step_s"]
        row["lockstep"] = plain_steps / (max(spec_steps, 1) * tau)
        if args.continuous_requests:
            row["continuous"] = measure_continuous(target, draft, probs, args, batch=batch, context=context,
                                                   block=block, forwards_s=d + v,
                                                   step_loop_s=row["step_split_s"]["step_loop"],
                                                   stage=lambda name: stage(f"continuous batching, {name}"), bar=bar)
    return row


def _continuous_call(target, draft, requests, slots: int, start, bar, **options):
    """One ``continuous_generate`` pass of ``requests`` through ``slots`` slots: its outputs, decode time (the wall
    time less the admissions, i.e. less every prefill; compilation excluded by its warm-up), loop and row steps;
    ``start()`` before it, ``bar`` one part per finished request."""
    from dflash_jax.decode import RunStats, continuous_generate

    def call():
        stats = RunStats()
        start()
        rows = continuous_generate(target, draft, requests, max_batch=slots, stats=stats,
                                   on_result=lambda i, r: bar.update(1), **options)
        return types.SimpleNamespace(rows=rows, output_ids=[r.output_ids for r in rows],
                                     wall_time_s=stats.wall_time_s - stats.admit_time_s, loop_steps=stats.loop_steps,
                                     occupancy=stats.occupancy)

    return call


def measure_continuous(target, draft, probs, args, *, batch: int, context: int, block: int, forwards_s: float,
                       step_loop_s: float, stage, bar) -> dict:
    """``--continuous-requests N``: N requests through ``batch`` slots, plain and replayed DFlash, prefill excluded
    (every admission is timed and subtracted); the limit is the closed batch's formula with this run's plain step
    and tau over the closed batch's draft + verify forwards (``forwards_s``, same batch and context); ``runs_s``:
    the DFlash step less the whole step timed alone (``step_loop_s``), what running it call by call adds."""
    from dflash_jax.synthetic import ReplayProposer

    n = args.continuous_requests
    rng = np.random.default_rng([args.seed, batch, context, n])
    requests = rng.integers(0, target.config.vocab_size, (n, context)).tolist()  # request i: key stream i
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=(), attention_impl=args.attention,
              max_length=args.max_length)
    plain = _continuous_call(target, None, requests, batch, lambda: stage("plain"), bar, **kw)
    runs = [plain()]  # also the references
    replay = ReplayProposer(reference=runs[0].output_ids, probs=probs)
    spec_call = _continuous_call(target, draft, requests, batch, lambda: stage("DFlash"), bar, block_size=block,
                                 proposer=replay, **kw)
    runs = [(runs[0], spec_call())] + [(plain(), spec_call()) for _ in range(args.repeats - 1)]  # alternating
    if any(p_run.output_ids != runs[0][0].output_ids for p_run, _ in runs):
        die("continuous batching: plain decoding gave different outputs on repeated runs")
    bad = sorted({i for p_run, s_run in runs for i, (a, b) in enumerate(zip(p_run.output_ids, s_run.output_ids))
                  if a != b})
    if bad:
        i = bad[0]
        p_run, s_run = next(r for r in runs if r[0].output_ids[i] != r[1].output_ids[i])
        mismatch = first_mismatch(target, p_run.rows[i], s_run.rows[i])
        msg = (f"continuous batching, batch {batch}, context {context}: replayed DFlash output differs from plain "
               f"decoding in {len(bad)} request(s); first request {i}, generated token {mismatch['position']} "
               f"(target's top-2 logit gap {mismatch['top2_logit_gap']:.4g})")
        _report_mismatch(msg, mismatch["top2_logit_gap"], target)
    base, spec = (min((r[m] for r in runs), key=lambda g: g.wall_time_s) for m in (0, 1))
    tau = float(np.mean([a for r in spec.rows for a in r.acceptance_lengths]))
    plain_step = base.wall_time_s / max(base.loop_steps, 1)
    out = {"requests": n, "slots": batch, "tau": tau, "plain_loop_steps": base.loop_steps,
           "dflash_loop_steps": spec.loop_steps, "occupancy": spec.occupancy,
           "plain_decode_s": base.wall_time_s, "dflash_decode_s": spec.wall_time_s, "plain_step_s": plain_step,
           "dflash_step_s": spec.wall_time_s / max(spec.loop_steps, 1),
           "decode_speedup": base.wall_time_s / max(spec.wall_time_s, 1e-12), "identical": not bad}
    out["speedup_limit"] = tau * plain_step / forwards_s
    out["efficiency_vs_limit"] = out["decode_speedup"] / out["speedup_limit"]
    # the same two factors, exactly: plain loop steps / (DFlash loop steps x tau) (1 with every slot busy), its step
    out["lockstep"] = base.loop_steps / (max(spec.loop_steps, 1) * tau)
    out["step_efficiency"] = forwards_s / out["dflash_step_s"]
    out["runs_s"] = out["dflash_step_s"] - step_loop_s
    return out


def run(args) -> int:
    """The synthetic benchmark (``--synthetic``); rows printed as text or JSON lines."""
    from dflash_jax import synthetic as syn
    from dflash_jax.machine import machine, warn_if_busy

    if args.target or args.draft or args.prompts_file or args.plot:
        die("--synthetic builds its own target, draft and prompts: drop --target / --draft / --prompts-file / --plot")
    if args.temperature != 0:
        die("--synthetic replays greedy acceptance: use --temperature 0")
    if args.verify_lengths is not None:
        die("--verify-lengths does not apply to --synthetic: its acceptance is replayed, so the confidence of its "
            "random draft says nothing; measure adaptive verify on a trained pair (python -m infer.benchmark)")
    if args.tree_budget:
        die("--tree-budget does not apply to --synthetic: its replayed acceptance is a chain's; measure tree "
            "verification on a trained pair (python -m infer.benchmark)")
    if args.continuous_requests is not None and args.no_timing_split:
        die("--continuous-requests reports against the limit of the timed forwards: drop --no-timing-split")
    try:
        preset = syn.preset(args.synthetic)
    except ValueError as e:
        die(str(e))
    batches, contexts = parse_ints(args.batch_size or "1", "--batch-size"), parse_ints(args.context or "1024", "--context")
    if args.continuous_requests is not None and args.continuous_requests <= max(batches):
        die(f"--continuous-requests {args.continuous_requests}: more requests than --batch-size {max(batches)} slots "
            "are needed to refill any slot")
    block = fixed_block_size(args) or preset.block_size  # auto: the preset's block (acceptance is replayed)
    if not 2 <= block <= preset.block_size:
        die(f"--block-size must be in [2, {preset.block_size}] for preset {args.synthetic}, got {block}")
    probs, desc = replay_distribution(args, block)
    import jax

    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    mesh = None
    if args.mesh:
        from dflash_jax import sharding

        sharding.maybe_initialize_distributed()
        mesh = sharding.make_mesh(args.mesh)
    target, draft = syn.synthetic_pair(args.synthetic, dtype, mesh, seed=args.seed, scan_layers=args.scan_layers)
    sizes = {"target_params": syn.num_params(target.params), "draft_params": syn.num_params(draft.params)}
    print(f"synthetic {args.synthetic}: {preset.source}; random {dtype} weights ({sizes['target_params'] / 1e9:.3g}B "
          f"target, {sizes['draft_params'] / 1e9:.3g}B draft); acceptance SIMULATED", file=sys.stderr)
    where = machine()
    warn_if_busy(where)
    rows = []
    with progress_bar(len(batches) * len(contexts) * stages(args), "synthetic benchmark", "part",
                      shows_bar(args)) as bar:
        for batch in batches:
            for context in contexts:
                row = measure(target, draft, probs, args, batch=batch, context=context, block=block, bar=bar)
                row.update(replay=desc, dtype=dtype, machine=where, **sizes)
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print_text(rows, args, desc, dtype, where)
    return 0


def print_text(rows, args, desc, dtype, where) -> None:
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    print(f"SYNTHETIC benchmark, preset {args.synthetic}: random {dtype} weights; acceptance is SIMULATED (replay "
          f"draft: the target's own continuation cut at lengths drawn from a {desc['distribution']} with mean "
          f"{desc['requested_tau']:.2f}); {args.max_new_tokens} new tokens per row, block {rows[0]['block_size']}")
    split = not args.no_timing_split
    print(f"{'batch':>5} {'context':>7} {'tau':>5} {'plain step':>10} {'DFlash step':>11}"
          + (f" {'= draft':>8} {'+ verify':>8} {'+ rest':>7} {'(accept':>7} {'writes':>6} {'commit':>6} "
             f"{'other':>6} {'runs)':>6} {'verify 1':>8}" if split else "")
          + f" {'speedup':>7} {'decode':>7} {'efficiency':>10}" + (f" {'vs limit':>8} {'= lockstep':>10} {'x step':>6}" if split else "") + " same")
    for r in rows:
        b = r["block_size"]
        print(f"{r['batch_size']:>5} {r['context']:>7} {r['tau']:>5.2f} {ms(r['plain_step_s']):>10} "
              f"{ms(r['dflash_step_s']):>11}"
              + (f" {ms(r['step_split_s']['draft']):>8} {ms(r['step_split_s']['verify']):>8} "
                 f"{ms(r['step_split_s']['rest']):>7} {ms(r['step_split_s']['acceptance']):>7} "
                 f"{ms(r['step_split_s']['cache_writes']):>6} {ms(r['step_split_s']['commit']):>6} "
                 f"{ms(r['step_split_s']['other']):>6} {ms(r['step_split_s']['runs']):>6} "
                 f"{ms(r['verify_forward_s_block1']):>8}" if split else "")
              + f" {r['speedup']:>6.2f}x {r['decode_speedup']:>6.2f}x {r['engine_efficiency']:>10.2f}"
              + (f" {r['efficiency_vs_limit']:>8.2f} {r['lockstep']:>10.2f} {r['step_efficiency']:>6.2f}" if split else "")
              + f" {r['identical']}")
    for r in rows:
        c = r.get("continuous")
        if c:
            print(f"continuous batching, batch {r['batch_size']}, context {r['context']}: {c['requests']} requests "
                  f"through {c['slots']} slots, occupancy {c['occupancy']:.2f}, tau {c['tau']:.2f}, plain step "
                  f"{ms(c['plain_step_s'])}, DFlash step {ms(c['dflash_step_s'])}, decode {c['decode_speedup']:.2f}x "
                  f"vs limit {c['speedup_limit']:.2f}x: {c['efficiency_vs_limit']:.2f} = lockstep "
                  f"{c['lockstep']:.2f} x step {c['step_efficiency']:.2f} (runs {ms(c['runs_s'])}), same "
                  f"{c['identical']}")
    print(f"times in ms per loop step (prefill excluded; verify 1: one target forward of 1 token, verify: of {b}); "
          "speedup: whole calls, prefill included; decode: prefill excluded; efficiency = decode speedup / tau; "
          "vs limit: decode speedup / (tau x plain step / (draft + verify)) = lockstep (a closed batch steps until its "
          "slowest row ends: plain steps / (DFlash steps x tau)) x step ((draft + verify) / DFlash step); accept / writes / commit: the rest's "
          "named parts, each timed alone; other: the unnamed rest of the whole step timed alone; runs: the DFlash step "
          "less that (device calls, the host between them)")
    print(f"measured on {where['device']} ({where['backend']}, {where['num_devices']} device(s)), "
          f"{where['cpu_count']} CPUs, load average {where['load_average'][0]}, GLIBC_TUNABLES "
          f"{where['glibc_tunables']}")
