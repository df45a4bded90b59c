"""What fits on a TPU slice and how fast, before renting one: ``python -m infer.plan --target qwen3-8b --topology v6e-8``.

Compiles, for the slice's abstract devices on this host (libtpu from the ``plan`` extra: ``pip install -e ".[plan]"``;
no device, no weights), every program the server runs (the page pool's creation, an admission's prefill at each
prompt bucket, the paged run at each bucket of live rows, the progress reads, release and take; tree verification
with ``--tree-budget``), the closed batch's step, and plain decoding's run at the rows predicted for. One row a
program: compiled or the error in one line, Mosaic kernels inside, per-chip memory (XLA's memory analysis) against
the chip's HBM, XLA's flops and bytes, HBM bytes and a roofline time (``dflash_jax.on_paper``); then the pool's pages
and the rows of 1k / 4k tokens they hold, and predicted plain and DFlash output tokens/s per replica at batch 1, 8
and 64 for an acceptance length ``--tau``. Every figure is on paper: docs/tpu-on-paper.md says what each means.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

GB = 1e9
PAPER_TAU = 6.49  # the paper's mean acceptance length, Qwen3-8B, block 16, greedy (docs/benchmarks.md)
PREDICT_BATCHES = (1, 8, 64)
HBM_USE = 0.9  # of a chip's HBM the plan gives the weights, the pool and the programs' temporaries


def parse_args(argv=None):
    from dflash_jax.chips import CHIPS

    p = argparse.ArgumentParser(prog="python -m infer.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen3-8b",
                   help="a preset (infer.presets: qwen3-8b, qwen3-coder-30b-a3b, gpt-oss-120b, qwen3.5-27b, "
                        "deepseek-v3, kimi-k2.5, gemma-4-31b, ...), a config.json, a checkpoint directory, or a hub id "
                        "whose config is in the local cache (default qwen3-8b)")
    p.add_argument("--draft", help="the draft's config.json / directory / hub id (default: the preset's; a target "
                                   "given by its config gets a 5-layer DFlash draft of its widths)")
    p.add_argument("--no-draft", action="store_true", help="plan plain decoding only")
    p.add_argument("--topology", required=True,
                   help=f"a TPU slice: an accelerator type (v5e-8, v6e-4, v5p-64, v7x-8) or a grid (v6e:2x4); chips: "
                        f"{', '.join(CHIPS)}; or local: this host's devices (a TPU VM, or an H100 / H200: what "
                        "scripts/gpu_benchmarks.sh holds against the same device's measurements)")
    p.add_argument("--mesh", help="mesh axis sizes over the slice's devices, e.g. tensor=8 or expert=8,tensor=4 "
                                  "(default: every device on tensor)")
    p.add_argument("--max-batch", type=int, default=64, help="the server's rows (default 64)")
    p.add_argument("--max-length", type=int, default=2048, help="prompt + generated tokens of a row (default 2048)")
    p.add_argument("--kv-cache-memory", type=float,
                   help="GB of page pool over the slice (default: what the chips' HBM leaves after the weights, "
                        f"{HBM_USE:.0%} of HBM in all)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16, the TPU default)")
    p.add_argument("--block-size", type=int, help="the verify block (default: the draft's)")
    p.add_argument("--prompt-lengths", default="128,2048",
                   help="prompt lengths whose admission programs to compile (default 128,2048; cut to --max-length)")
    p.add_argument("--tree-budget", type=int, default=0, help="also tree verification with this many draft nodes")
    p.add_argument("--scan-layers", action="store_true", help="the target's layers scanned (dflash_jax.layer_scan)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tau", type=float, default=PAPER_TAU,
                   help=f"acceptance length for the DFlash prediction (default {PAPER_TAU}, the paper's Qwen3-8B)")
    p.add_argument("--train", action="store_true",
                   help="also the trainer's optimizer step (python -m train, online: the target's features computed "
                        "in the step) for the draft, at --train-seq-len and --train-batch over --train-mesh")
    p.add_argument("--train-only", action="store_true", help="the trainer's step alone (no server programs)")
    p.add_argument("--train-seq-len", type=int, default=2048, help="tokens a training row holds (default 2048)")
    p.add_argument("--train-batch", type=int,
                   help="rows per optimizer step, the global batch (default: one a device)")
    p.add_argument("--train-mesh", help="the trainer's mesh over the slice (default: every device on fsdp)")
    p.add_argument("--no-hbm-cost", action="store_true",
                   help="skip the HBM cost compiles (half the time; no roofline or prediction)")
    p.add_argument("--json", action="store_true", help="one JSON object: the plan, every program. Exit status: 0 "
                   "every program compiled and fits, 3 one does not fit the chip's HBM, 1 one did not compile")
    a = p.parse_args(argv)
    a.train = a.train or a.train_only
    if a.train and a.no_draft:
        p.error("--train plans the draft's training: drop --no-draft")
    for name in ("max_batch", "max_length", "page_size", "train_seq_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.tau < 1:
        p.error("--tau must be >= 1 (tokens a verify step commits)")
    if a.train_batch is not None and a.train_batch < 1:
        p.error("--train-batch must be >= 1")
    return a


def roofline(program, per_device) -> float | None:
    """Seconds of one run of a program: max(flops / peak, HBM bytes / bandwidth), per device."""
    if program.hbm_bytes is None:
        return None
    peak, _, bandwidth = per_device
    return max(program.hbm_flops / peak, program.hbm_bytes / bandwidth)


def plan(a) -> dict:
    """Compile what ``a`` asks for and account for it -> the plan as a dict (``--json``'s)."""
    from tqdm.auto import tqdm

    from dflash_jax import chips, on_paper
    from dflash_jax.sharding.mesh import make_mesh, mesh_str
    from infer import presets

    sl = chips.parse_slice(a.topology)
    devices = sl.devices()
    mesh = make_mesh(a.mesh or f"tensor={len(devices)}", devices=devices)
    tcfg, dcfg, source = presets.resolve(a.target, None if a.no_draft else (a.draft or "auto"), a.scan_layers)
    per_device = sl.per_device(len(devices))
    programs = [] if a.train_only else _programs(a, tcfg, dcfg, mesh)
    if a.train:
        programs.append(_train_program(a, tcfg, dcfg, devices))
    bar = tqdm(total=len(programs), desc="compiling", unit="program", disable=None, file=sys.stderr)
    results, context = [], {}
    for name, build, hbm in programs:
        bar.set_postfix_str(name)
        results.append(on_paper.compile_program(name, lambda: build(context), hbm_cost=hbm and not a.no_hbm_cost,
                                                tpu=sl.chip.name in chips.CHIPS))
        bar.update(1)
    bar.close()
    return _account(a, sl, mesh, mesh_str(mesh), tcfg, dcfg, source, per_device, results, context)


def _programs(a, tcfg, dcfg, mesh) -> list:
    """(name, build(context) -> Lowered, count HBM) of every program planned, in order (the pool's creation first:
    its output is the state the others take)."""
    import jax

    from dflash_jax import on_paper
    from dflash_jax.decode import prepare, steps
    from dflash_jax.decode.options import DecodeOptions
    from dflash_jax.decode.slots import PROGRESS_STEPS, row_buckets
    from dflash_jax.state import NO_PAGE

    target, draft = on_paper.pair(tcfg, dcfg, mesh, a.dtype)
    rows_n = a.max_batch
    out = []
    every = row_buckets(rows_n)
    predicted = [b for b in every if b in PREDICT_BATCHES or b == rows_n]  # HBM counted: the roofline's rows

    def engine(draft_, page, rows, max_length, block=None, tree=0):
        opts = DecodeOptions(max_new_tokens=max_length, max_length=max_length,
                             block_size=block or a.block_size or (draft_.config.block_size if draft_ else 1),
                             tree_budget=tree)
        limit = min(max_length, tcfg.max_position_embeddings)
        cache_len = prepare.cache_length([1], [limit - 1], opts.max_block(draft_), opts.cache_len)
        if page:
            cache_len = prepare.round_up(cache_len, page)
        spec, inputs = prepare.engine(target, draft_, opts, cache_len, greedy=True, rows=rows, page=page)
        inputs = jax.tree_util.tree_map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else
                                        on_paper.abstract(np.asarray(x), mesh), inputs)
        return spec, inputs, opts, limit

    def rows_of(spec, opts, lengths, pad_to, limit):
        prompts = [np.zeros((n,), np.int32) for n in lengths]
        budget = prepare.budgets([len(p) for p in prompts], [opts] * len(prompts), limit)
        bucket = prepare.prompt_bucket(max(lengths), spec.cache_len)
        rows = prepare.make_rows(spec, prompts, budget, [opts] * len(prompts), range(len(prompts)), pad_to=pad_to,
                                 bucket=bucket)
        return on_paper.abstract(rows, mesh)

    def empty_state(spec, inputs, opts, limit, pages):
        """The engine's empty state (``steps.empty``: every row free; paged: the pool) -> (its program lowered,
        the state as ShapeDtypeStructs on the shardings that program gives it, what every other program takes)."""
        rows = rows_of(spec, opts, [1], rows_n, limit)
        lowered = steps.empty_jit.trace(spec, inputs, rows, pages).lower()
        state = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                       lowered.out_info, lowered.compile().output_shardings)
        return lowered, state

    def paged(kind, draft_, ctx_key, buckets, with_server):
        def setup(ctx):
            if ctx_key not in ctx:
                spec, inputs, opts, limit = engine(draft_, a.page_size, rows_n, a.max_length)
                pages, per_page = _pool_pages(a, spec, inputs, mesh, lambda n: on_paper.device_bytes(
                    empty_state(spec, inputs, opts, limit, n)[1]))
                ctx[ctx_key] = dict(spec=spec, inputs=inputs, opts=opts, limit=limit, pages=pages,
                                    page_device_bytes=per_page)
            return ctx[ctx_key]

        def empty(ctx):
            e = setup(ctx)
            lowered, e["state"] = empty_state(e["spec"], e["inputs"], e["opts"], e["limit"], e["pages"])
            return lowered

        def state(ctx):
            e = setup(ctx)
            if "state" not in e:
                empty(ctx)
            return e

        def admit(n):
            def build(ctx):
                e = state(ctx)
                rows = rows_of(e["spec"], e["opts"], [n], 1, e["limit"])
                at = on_paper.abstract(np.zeros((1,), np.int32), mesh)
                table = on_paper.abstract(np.full((1, e["spec"].cache_len // e["spec"].page), NO_PAGE, np.int32),
                                          mesh)
                return steps.admit_jit.trace(e["spec"], e["inputs"], e["state"], rows, at, table).lower()
            return build

        def run(b):
            def build(ctx):
                e = state(ctx)
                at = on_paper.abstract(np.zeros((b,), np.int32), mesh)
                n = on_paper.abstract(np.int32(PROGRESS_STEPS), mesh)
                return steps.run_rows_jit.trace(e["spec"], e["inputs"], e["state"], at, n).lower()
            return build

        def small(fn, **static):
            def build(ctx):
                e = state(ctx)
                at = on_paper.abstract(np.zeros((rows_n,), np.int32), mesh)
                args = () if fn is steps.read_jit else (at,)
                return fn.trace(e["spec"], e["inputs"], e["state"], *args, **static).lower()
            return build

        progs = [(f"{kind} pool + state ({rows_n} rows)", empty, False)] if with_server else []
        if with_server:
            for n in _prompt_lengths(a):
                progs.append((f"{kind} admit prompt {n}", admit(n), False))
        progs += [(f"{kind} run {b} rows", run(b), b in predicted) for b in buckets]
        if with_server:
            progs += [(f"{kind} read {k} steps", small(steps.read_jit, steps=k), False)
                      for k in (1 << i for i in range(PROGRESS_STEPS.bit_length()))]
            progs += [(f"{kind} release", small(steps.release_jit), False), (f"{kind} take", small(steps.take_jit),
                                                                              False)]
        return progs

    if draft is not None:
        out += paged("dflash", draft, "dflash", every, True)
    out += paged("plain", None, "plain", every if draft is None else predicted, draft is None)

    def closed(tree):
        def build(ctx):
            spec, inputs, opts, limit = engine(draft, 0, rows_n, a.max_length, tree=tree)
            return steps.step_jit.trace(spec, inputs, empty_state(spec, inputs, opts, limit, 0)[1]).lower()
        return build

    if draft is not None:
        out.append((f"closed-batch step ({rows_n} rows)", closed(0), True))
        if a.tree_budget:
            out.append((f"tree verify step ({rows_n} rows, {a.tree_budget} nodes)", closed(a.tree_budget), True))
    return out


def _train_program(a, tcfg, dcfg, devices):
    """(name, build, count HBM) of the trainer's optimizer step (``train.step.make_train_step``, one micro-batch of
    ``--train-batch`` rows of ``--train-seq-len`` tokens, packed rows, the target's features computed in the step)
    with its draft parameters and optimizer state in float32 and the target in ``--dtype``, over the training mesh.
    Sets ``a.train_batch`` to its default (one row a device) when not given."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import on_paper, sharding
    from dflash_jax.drafts.model import draft_param_shapes
    from dflash_jax.sharding.mesh import make_mesh
    from train.config import TrainConfig
    from train.step import draft_optimizer, make_train_step, state_shardings

    mesh = make_mesh(a.train_mesh or f"fsdp={len(devices)}", devices=devices)
    a.train_batch = rows = a.train_batch or len(devices)
    sharding.check_batch_rows(rows, mesh, "--train-batch")
    cfg = TrainConfig(seq_len=a.train_seq_len, batch_size=rows, dtype=a.dtype, mesh=sharding.mesh_str(mesh),
                      block_size=dcfg.block_size)

    def build(ctx):
        target, _ = on_paper.pair(tcfg, None, mesh, a.dtype)
        optimizer = draft_optimizer(cfg, dcfg)
        step = make_train_step(cfg, tcfg, dcfg, optimizer, offline=False, mesh=mesh)
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(cfg.param_dtype)),
                                        draft_param_shapes(dcfg))
        opt = jax.eval_shape(optimizer.init, shapes)
        p_shard, o_shard = state_shardings(mesh, tcfg, dcfg, shapes, opt)
        params, opt = sharding.abstract_like(shapes, p_shard), sharding.abstract_like(opt, o_shard)
        batch = lambda *shape: jax.ShapeDtypeStruct(  # noqa: E731
            shape, jnp.int32, sharding=sharding.batch_sharding(mesh, len(shape), batch_axis=1))
        tokens = batch(1, rows, a.train_seq_len)
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=jax.sharding.NamedSharding(  # noqa: E731
            mesh, jax.sharding.PartitionSpec()))
        return step.trace(params, opt, target.params, tokens, tokens, batch(1, rows), scalar(jnp.int32), None,
                          scalar(jnp.float32), tokens).lower()

    return f"train step ({rows} rows of {a.train_seq_len} tokens, mesh {sharding.mesh_str(mesh)})", build, True


def _prompt_lengths(a) -> list[int]:
    return sorted({min(int(n), a.max_length - 1) for n in a.prompt_lengths.split(",") if n.strip()})


def _pool_pages(a, spec, inputs, mesh, state_bytes) -> tuple[int, float]:
    """(pages of the pool, bytes a page costs each device). The pages: ``--kv-cache-memory`` GB over the slice (as
    ``infer.serve`` takes it), or what HBM_USE of a chip's HBM leaves after the weights and the rows' records; a page's
    bytes per device from the empty state's size at two pool sizes (``state_bytes(pages)``, per device: a layer whose
    K/V heads do not split over the mesh, a latent cache, keeps its pages whole on every device). At least one row
    of the max length."""
    from dflash_jax import chips, on_paper
    from dflash_jax.decode import steps

    longest = -(-(a.max_length + spec.max_block) // spec.page)
    one, two = state_bytes(longest), state_bytes(2 * longest)
    per_page = max((two - one) / longest, 1.0)
    if a.kv_cache_memory is not None:
        return max(int(a.kv_cache_memory * GB // steps.page_bytes(spec, inputs)), longest), per_page
    rest = one - longest * per_page  # the rows' records, per device
    weights = on_paper.device_bytes((inputs.tparams, inputs.dparams))
    hbm = chips.parse_slice(a.topology).per_device(mesh.devices.size)[1]
    return max(int((HBM_USE * hbm - weights - rest) // per_page), longest), per_page


def _account(a, sl, mesh, mesh_text, tcfg, dcfg, source, per_device, results, context) -> dict:
    from dflash_jax import on_paper
    from dflash_jax.decode import steps

    peak, hbm, bandwidth = per_device
    rows = []
    for r in results:
        d = r.as_dict()
        d["fits"] = bool(r.compiled and r.memory.get("peak_bytes", 0) <= hbm)
        # XLA counts a loop's body once: a scanned target's layers are one scan step in its cost, so no roofline
        d["roofline_s"] = None if a.scan_layers else roofline(r, per_device)
        rows.append(d)
    out = {"target": a.target, "source": source, "draft": None if dcfg is None else "DFlash draft, "
           f"{dcfg.layers.num_hidden_layers} layers, block {dcfg.block_size}", "topology": sl.name,
           "chip": dataclasses.asdict(sl.chip), "devices": int(mesh.devices.size), "mesh": mesh_text,
           "dtype": a.dtype, "max_batch": a.max_batch, "max_length": a.max_length, "page_size": a.page_size,
           "scan_layers": a.scan_layers, "tau": a.tau, "hbm_per_device_bytes": hbm, "programs": rows}
    e = context.get("dflash") or context.get("plain")
    if e is not None:
        weights = on_paper.device_bytes((e["inputs"].tparams, e["inputs"].dparams))
        out["weights_per_device_bytes"] = weights
        out["pool"] = {"pages": e["pages"], "page_bytes": steps.page_bytes(e["spec"], e["inputs"]),
                       "page_bytes_per_device": e["page_device_bytes"],
                       "bytes_per_device": e["pages"] * e["page_device_bytes"],
                       **{f"rows_at_{n}": e["pages"] // -(-(n + e["spec"].max_block) // e["spec"].page)
                          for n in (1024, 2048, 4096)}}
        if not a.scan_layers:  # a scanned target's bytes are one layer of each group (no roofline either)
            _ideal(rows, context, a.max_length)
    for r in rows:  # XLA refused to place it in the chip's HBM: compiled but for that, a program that does not fit
        r["out_of_memory"] = not r["compiled"] and "RESOURCE_EXHAUSTED" in (r["error"] or "")
    out["all_compiled"] = all(r["compiled"] or r["out_of_memory"] for r in rows)
    out["all_fit"] = all(r["fits"] for r in rows)
    out["prediction"] = _predict(a, rows)
    train = next((r for r in rows if r["name"].startswith("train step") and r["compiled"]), None)
    if train is not None:
        out["train"] = {"rows": a.train_batch, "seq_len": a.train_seq_len, "step_s": train["roofline_s"],
                        "tokens_per_s": None if not train["roofline_s"] else
                        a.train_batch * a.train_seq_len / train["roofline_s"]}
    return out


def _ideal(rows, context, max_length) -> None:
    """Each run's ideal HBM bytes a step, per device, beside its own (``ideal_bytes``, ``over_ideal``): every weight
    once, a DFlash step's LM head once more (the draft's logits), and its rows' pages at the max length (the
    decode kernels read a row's pages up to its length). The activations are not in it: at 1 row a step they are a
    few MB; at 64 rows of 16-token blocks on a tensor-split mesh, where each chip carries every token's hidden
    state, most of a step's excess (docs/tpu-on-paper.md)."""
    from dflash_jax import on_paper

    for r in rows:
        kind, _, rest = r["name"].partition(" run ")
        e = context.get(kind)
        if not rest or r["hbm_bytes"] is None or e is None:
            continue
        inputs, n = e["inputs"], int(rest.split()[0])
        pages_per_row = -(-(max_length + e["spec"].max_block) // e["spec"].page)
        weights = on_paper.device_bytes((inputs.tparams, inputs.dparams))
        head = on_paper.head_bytes(inputs.tparams) if inputs.dparams is not None else 0
        r["ideal_bytes"] = weights + head + n * pages_per_row * e["page_device_bytes"]
        r["over_ideal"] = r["hbm_bytes"] / r["ideal_bytes"]


def _predict(a, rows) -> list[dict]:
    """Output tokens/s per replica at each planned batch: plain b / t(plain run of b rows), DFlash b * tau /
    t(DFlash run of b rows), t the roofline of one step."""
    def time_of(kind, b):
        r = next((r for r in rows if r["name"] == f"{kind} run {b} rows" and r["compiled"]), None)
        return None if r is None else r["roofline_s"]

    out = []
    for b in sorted({b for b in PREDICT_BATCHES if b <= a.max_batch} | {a.max_batch}):
        plain, dflash = time_of("plain", b), time_of("dflash", b)
        out.append({"batch": b, "plain_step_s": plain, "dflash_step_s": dflash,
                    "plain_tokens_per_s": None if not plain else b / plain,
                    "dflash_tokens_per_s": None if not dflash else b * a.tau / dflash,
                    "speedup": None if not (plain and dflash) else (b * a.tau / dflash) / (b / plain)})
    return out


def _fmt_bytes(x) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def print_plan(p: dict) -> None:
    hbm = p["hbm_per_device_bytes"]
    print(f"{p['target']} ({p['source']}); {p['draft'] or 'no draft'}; {p['topology']} ({p['devices']} devices of "
          f"{p['chip']['device_kind']}, {hbm / GB:.1f} GB HBM each), mesh {p['mesh']}, {p['dtype']}"
          f"{', layers scanned' if p['scan_layers'] else ''}; on paper (compiled here, not run)")
    if "pool" in p:
        pool = p["pool"]
        print(f"weights {p['weights_per_device_bytes'] / GB:.2f} GB per device; page pool {pool['pages']} pages of "
              f"{p['page_size']} tokens ({pool['bytes_per_device'] / GB:.2f} GB per device): rows of 1k / 2k / 4k tokens "
              f"{pool['rows_at_1024']} / {pool['rows_at_2048']} / {pool['rows_at_4096']}")
    print("| program | compiled | Mosaic | peak GB/device | fits | XLA GFLOP | XLA GB | HBM GB | x ideal | roofline ms |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in p["programs"]:
        if not r["compiled"]:
            print(f"| {r['name']} | no: {r['error']} | | | | | | | | |")
            continue
        t, x = r["roofline_s"], r.get("over_ideal")
        print(f"| {r['name']} | yes | {r['mosaic']} | {r['memory']['peak_bytes'] / GB:.2f} | "
              f"{'yes' if r['fits'] else 'NO'} | {r['flops'] / 1e9:.1f} | {r['bytes'] / GB:.2f} | "
              f"{_fmt_bytes(r['hbm_bytes'])} | {'-' if x is None else f'{x:.2f}'} | "
              f"{'-' if t is None else f'{t * 1e3:.2f}'} |")
    for r in p["programs"]:
        if r["out_of_memory"]:
            print(f"does not fit: {r['name']}: {r['error'].split(': ', 2)[-1]}")
        if r["compiled"] and not r["fits"]:
            m = r["memory"]
            print(f"does not fit: {r['name']} needs {m['peak_bytes'] / GB:.2f} GB per device (arguments "
                  f"{m['argument_bytes'] / GB:.2f}, temporaries {m['temp_bytes'] / GB:.2f}) of {hbm / GB:.1f} GB")
    if p["scan_layers"]:
        print("no roofline or prediction with --scan-layers: XLA's cost analysis counts a scan's body once (one layer "
              "of each group); plan the unrolled target for bytes and time")
        return
    if p.get("train", {}).get("tokens_per_s"):
        t = p["train"]
        print(f"training: {t['rows']} rows of {t['seq_len']} tokens a step, {t['step_s'] * 1e3:.1f} ms on paper, "
              f"{t['tokens_per_s']:,.0f} tokens/s over the slice (roofline)")
    if not any(q["plain_tokens_per_s"] or q["dflash_tokens_per_s"] for q in p["prediction"]):
        return
    print(f"predicted output tokens/s per replica (roofline, tau {p['tau']}):")
    for q in p["prediction"]:
        f = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
        print(f"  batch {q['batch']}: plain {f(q['plain_tokens_per_s'])}, DFlash {f(q['dflash_tokens_per_s'])}"
              + ("" if q["speedup"] is None else f" ({q['speedup']:.2f}x)"))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.topology.strip().lower() != "local":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host only compiles: none of its own devices is used
    from dflash_jax.launch import launch

    launch()
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # programs for devices this host lacks: nothing to keep
    try:
        p = plan(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(p))
    else:
        print_plan(p)
    return 1 if not p["all_compiled"] else 0 if p["all_fit"] else 3


if __name__ == "__main__":
    sys.exit(main())
