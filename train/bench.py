"""Training throughput: one optimizer step of ``python -m train`` at a given shape, timed after warm-up.

    python -m train.bench --preset tiny                       # seconds on a CPU
    python -m train.bench --preset qwen3-8b-paper --impl kernel --json   # the paper's shape (GPU / TPU)
    python -m train.bench --target /path/to/Qwen3-8B --seq-len 3072 --batch-size 4 --mesh auto

The step is the trainer's own (``train.step.cached_train_step``: grad accumulation, AdamW, online or
offline features). Three jitted functions are timed, each after compilation and ``--warmup`` calls, over
``--repeats`` calls (the median is reported, the minimum beside it):

* ``features``: the frozen target's feature forward alone over the step's micro-batches (what the
  online step runs inside it);
* ``draft_step``: the offline-features step (random features of the right width fed in): the draft's
  forward, backward and optimizer update;
* ``online_step``: the full step with the target forward inside (what ``python -m train`` runs).

Tokens per second = sequence tokens of the step (grad_accum * batch_size * seq_len) / time. Model FLOPs
are counted analytically (``model_flops``; matmuls and attention scores, no elementwise work, no
recomputation) and cross-checked against XLA's ``cost_analysis()`` of the compiled function. MFU = model
FLOPs / time / (devices * peak bf16 FLOP/s of the device: ``PEAK_TFLOPS`` or ``--peak-tflops``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from dflash_jax.synthetic import preset as synthetic_preset
from dflash_jax.launch import launch

# name -> (synthetic target config (Hugging Face keys), shape defaults)
PRESETS = {
    # Qwen3-8B's dimensions (the synthetic benchmark's preset) with random weights; the paper's training
    # shape: 5-layer draft, block 16, 512 anchors, S = 3072; 16 sequences per optimizer step (4 per
    # micro-batch x 4 accumulated).
    "qwen3-8b-paper": (
        synthetic_preset("qwen3-8b").target.to_hf(),
        {"draft_layers": 5, "block_size": 16, "num_target_features": 5, "num_anchors": 512, "seq_len": 3072,
         "batch_size": 4, "grad_accum": 4, "dtype": "bfloat16"}),
    # a few-second CPU shape (the tests run it)
    "tiny": (
        {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 512},
        {"draft_layers": 1, "block_size": 4, "num_target_features": 2, "num_anchors": 16, "seq_len": 128,
         "batch_size": 2, "grad_accum": 1, "dtype": "float32"}),
}

# Peak dense bf16 FLOP/s per chip (TFLOP/s, no sparsity), matched in order against device_kind (lower case).
PEAK_TFLOPS = (
    ("h100 pcie", 756.0),
    ("h100", 989.4),     # SXM
    ("h200", 989.4),     # SXM
    ("a100", 312.0),
    ("tpu v4", 275.0),
    ("tpu v5 lite", 197.0), ("tpu v5e", 197.0),
    ("tpu v5p", 459.0), ("tpu v5", 459.0),
    ("tpu v6 lite", 918.0), ("tpu v6e", 918.0),
)

PHASES = ("features", "draft_step", "online_step")
SHAPE_FLAGS = ("draft_layers", "block_size", "num_target_features", "num_anchors", "seq_len", "batch_size",
               "grad_accum", "loss_chunk", "dtype")


class BenchError(ValueError):
    """A bad argument or an impossible setup: one line on stderr, exit 2."""


def peak_tflops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((v for k, v in PEAK_TFLOPS if k in kind), None)


# --- analytic FLOPs ---------------------------------------------------------------------------------


def _layer_matmul_params(c) -> int:
    """Weights a token multiplies through in one dense layer: q, k, v, o projections and the gated MLP."""
    d, qh, kvh = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return d * qh + 2 * d * kvh + qh * d + 3 * d * c.intermediate_size


def visible_keys(anchors, *, block_size: int, sliding_window: int | None = None) -> int:
    """Score entries the block attention's mask keeps (``kernels.block_attention.block_mask``), summed over
    blocks: block a (anchor >= 0) row k sees context positions p < a (and a + k - p < window) and its own
    block (|i - j| < window). Padding blocks (anchor < 0) see nothing. No window: sum Bk * (a + Bk)."""
    a = np.asarray(anchors, np.int64)
    a = a[a >= 0]
    bk = block_size
    if sliding_window is None:
        return int(np.sum(bk * (a + bk)))
    k = np.arange(bk)
    ctx = np.minimum(a[:, None], np.maximum(0, sliding_window - k - 1)[None, :]).sum()
    own = int((np.abs(k[:, None] - k[None, :]) < sliding_window).sum())
    return int(ctx + own * a.size)


def causal_keys(seq_len: int, sliding_window: int | None = None) -> int:
    """Score entries of a causal forward over positions 0..S-1: sum_i min(i + 1, window)."""
    i = np.arange(seq_len, dtype=np.int64)
    return int(np.sum(i + 1 if sliding_window is None else np.minimum(i + 1, sliding_window)))


def model_flops(tcfg, dcfg, *, seq_len: int, anchors) -> dict:
    """Model FLOPs of one optimizer step, summed over its sequences (``anchors`` [sequences, N], the
    anchors the step draws; -1 = padding block). With T = N * Bk block tokens per sequence, D hidden,
    V vocab, n fused target layers, H x h query heads, P = the per-layer matmul weights
    (q, k, v, o, gate, up, down), K x h key/value width:

    * draft layers' matmuls on the T block tokens      3 * 2 * T * layers * P      (forward + backward)
    * context K/V projections on the S tokens          3 * 2 * S * layers * 2 * D * K * h
    * fc (fused features -> hidden) on the S tokens    2 * 2 * S * n * D * D      (no input gradient)
    * attention over the visible keys                  3 * 4 * H * h * visible    per layer
    * lm_head on the T block tokens (frozen)           2 * 2 * T * D * V          (input gradient only)
    * target forward (frozen, no backward)             2 * S * Lf * P_t + 4 * H_t * h_t * S(S+1)/2 * Lf

    Lf = last feature layer + 1: the layers after it are unused (their output feeds only the logits, which
    the feature forward drops) and XLA removes them. ``visible`` = ``visible_keys``. Multiply-add = 2
    FLOPs; elementwise work (norms, RoPE, softmax, the optimizer) and the lm_head's recomputation under
    ``jax.checkpoint`` are not model FLOPs.
    """
    anchors = np.asarray(anchors)
    rows = anchors.shape[0]
    c, bk = dcfg.layers, dcfg.block_size
    t, s, layers = anchors.shape[1] * bk, seq_len, c.num_hidden_layers
    kvw = c.num_key_value_heads * c.head_dim
    visible = sum(visible_keys(anchors, block_size=bk, sliding_window=c.layer_window(i)) for i in range(layers))
    out = {
        "draft_layers": 3 * 2 * t * layers * _layer_matmul_params(c) * rows,
        "context_kv": 3 * 2 * s * layers * 2 * c.hidden_size * kvw * rows,
        "fc": 2 * 2 * s * dcfg.num_features * c.hidden_size * c.hidden_size * rows,
        "attention": 3 * 4 * c.num_attention_heads * c.head_dim * visible,
        "lm_head": 2 * 2 * t * c.hidden_size * tcfg.vocab_size * rows,
    }
    out["draft_step"] = sum(out.values())
    lf = max(dcfg.target_layer_ids) + 1
    scores = sum(causal_keys(s, tcfg.layer_window(i)) for i in range(lf))
    out["target_forward"] = (2 * s * lf * _layer_matmul_params(tcfg)
                             + 4 * tcfg.num_attention_heads * tcfg.head_dim * scores) * rows
    out["online_step"] = out["draft_step"] + out["target_forward"]
    return out


# --- setup -------------------------------------------------------------------------------------------


class _SyntheticData:
    """What ``train.step.device_batch`` reads from a ``TrainData``: ``batch(idx) -> (ids, mask, doc_start)``
    (unpacked: no doc_start)."""

    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def batch(self, idx):
        return self.ids[idx], self.mask[idx], None


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def setup(args):
    """Target, draft config / params / optimizer state, step function and a synthetic batch."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import model_sharding, sharding
    from dflash_jax.checkpoints import load_tokenizer, resolve_dtype
    from dflash_jax.config import TargetConfig
    from dflash_jax.drafts.model import draft_param_shapes
    from dflash_jax.layers import device_random_params
    from dflash_jax.target import Target, load_target, param_shapes
    from train import objective
    from train.config import TrainConfig
    from train.draft_setup import build_draft_config
    from train.step import cached_train_step, device_batch

    hf, shape = PRESETS[args.preset]
    shape = {k: getattr(args, k) if getattr(args, k) is not None else shape[k] for k in SHAPE_FLAGS
             if getattr(args, k) is not None or k in shape}
    try:
        cfg = TrainConfig(target=args.target or f"synthetic:{args.preset}", out="-", impl=args.impl, mesh=args.mesh,
                          seed=args.seed, **shape)
    except ValueError as e:
        raise BenchError(_one_line(e)) from None
    dtype = resolve_dtype(cfg.dtype)
    try:
        mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
        if mesh is not None:
            sharding.check_batch_rows(cfg.batch_size, mesh, "--batch-size (rows of a micro-batch)")
    except ValueError as e:
        raise BenchError(_one_line(e)) from None

    if args.target:
        if not os.path.isdir(args.target):
            raise BenchError(f"--target {args.target}: not a directory (a Hugging Face checkpoint directory)")
        try:
            target = (load_target(args.target, dtype=cfg.dtype) if mesh is None
                      else model_sharding.load_sharded(args.target, None, mesh, cfg.dtype)[0])
        except (OSError, ValueError, KeyError) as e:
            raise BenchError(f"--target {args.target}: {_one_line(e)}") from None
        tokenizer = load_tokenizer(target.path)
    else:
        tcfg = TargetConfig.from_hf(hf)
        shard = None if mesh is None else model_sharding.param_shardings(tcfg, mesh)
        target = Target(tcfg, device_random_params(param_shapes(tcfg), args.seed + 1, dtype, shard))
        tokenizer = None
    tcfg = target.config
    try:
        dcfg = build_draft_config(cfg, target, tokenizer)
    except ValueError as e:
        raise BenchError(_one_line(e)) from None
    if cfg.impl == "kernel" and not _kernel_ok(cfg.block_size, dcfg.layers.head_dim):
        raise BenchError(f"--impl kernel needs a TPU or a GPU of compute capability >= 8.0 (this is "
                         f"{jax.default_backend()}); use --impl auto, reference or interpret")

    param_dtype = resolve_dtype(cfg.param_dtype)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), draft_param_shapes(dcfg))
    p_shard = o_shard = None
    optimizer, _ = cached_train_step(cfg, tcfg, dcfg, offline=True)
    if mesh is not None:  # as train(): draft params and optimizer state over fsdp / tensor
        p_shard = model_sharding.param_shardings(dcfg, mesh, model_sharding.model_rules(mesh, tcfg, dcfg), shapes)
        o_shard = sharding.opt_state_shardings(jax.eval_shape(optimizer.init, shapes), p_shard, mesh, shapes)
    params = device_random_params(shapes, args.seed, param_dtype, p_shard)
    opt_state = jax.jit(optimizer.init, out_shardings=o_shard)(params)

    a, b, s = cfg.grad_accum, cfg.batch_size, cfg.seq_len
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, tcfg.vocab_size, (a * b, s), dtype=np.int32)
    mask = np.zeros((a * b, s), np.int32)
    mask[:, s // 8:] = 1  # a prompt, then the supervised response
    idx = np.arange(a * b).reshape(a, b)
    ids_d, mask_d, idx_d, _, _ = device_batch(_SyntheticData(ids, mask), None, idx, mesh, cfg.dtype)
    anchors = np.concatenate([np.asarray(objective.sample_batch_anchors(cfg.seed, 0, jnp.asarray(idx[i]),
                                                                        jnp.asarray(mask[idx[i]]), cfg.num_anchors))
                              for i in range(a)])
    return dict(cfg=cfg, mesh=mesh, target=target, dcfg=dcfg, params=params, opt_state=opt_state,
                ids=ids_d, mask=mask_d, idx=idx_d, anchors=anchors)


def _kernel_ok(block_size: int, head_dim: int) -> bool:
    from dflash_jax.attention import kernel_supported

    return kernel_supported(block_size=block_size, head_dim=head_dim)


# --- timing ------------------------------------------------------------------------------------------


def _xla_flops(compiled) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    f = (ca or {}).get("flops")
    return float(f) if f is not None and f >= 0 else None


def _peak_memory() -> tuple[float | None, str]:
    """(MiB, what it is): the devices' peak bytes in use, else this process's peak RSS."""
    import jax

    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [st.get("peak_bytes_in_use") for st in stats if st]
    if peaks and all(p is not None for p in peaks):
        return max(peaks) / 2**20, "device peak_bytes_in_use (max over devices)"
    from train.loop import peak_memory_mb

    return peak_memory_mb(), "host peak RSS (device memory stats unavailable on this backend)"


def time_fn(fn, args: tuple, thread=None, *, warmup: int, repeats: int) -> dict:
    """Compile ``fn`` (jitted) for ``args``, call it ``warmup`` times, then time ``repeats`` calls (each until
    its outputs are ready). ``thread(out, args) -> args``: the next call's arguments (donated state)."""
    import jax

    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()  # jit reuses this executable for the calls below
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        if thread is not None:
            args = thread(out, args)
    return {"time_s": statistics.median(times), "min_s": min(times), "times_s": times, "compile_s": compile_s,
            "xla_flops": _xla_flops(compiled)}


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from dflash_jax import sharding
    from dflash_jax.checkpoints import resolve_dtype
    from dflash_jax.machine import machine, warn_if_busy
    from train import objective
    from train.step import cached_train_step

    st = setup(args)
    cfg, dcfg, target, mesh = st["cfg"], st["dcfg"], st["target"], st["mesh"]
    tcfg = target.config
    a, b, s = cfg.grad_accum, cfg.batch_size, cfg.seq_len
    tokens = a * b * s
    flops = model_flops(tcfg, dcfg, seq_len=s, anchors=st["anchors"])
    dev = jax.devices()[0]
    peak, peak_src = _peak(args, dev.device_kind)
    n_dev = mesh.size if mesh is not None else 1
    where = machine()
    warn_if_busy(where)
    state = {"params": st["params"], "opt_state": st["opt_state"]}
    lr, epoch, phases = jnp.float32(1e-4), jnp.int32(0), {}

    # XLA's cost analysis counts a loop body once: its total is comparable only when the step has no loop that
    # runs more than once (one micro-batch, one lm_head chunk); a Pallas kernel counts as 0 FLOPs
    one_pass = {"features": a == 1, "draft_step": a == 1 and cfg.loss_chunk >= b * cfg.num_anchors * dcfg.block_size}
    one_pass["online_step"] = one_pass["draft_step"]

    def finish(name, r, model):
        r.update(tokens_per_s=tokens / r["time_s"], model_flops=model,
                 model_tflops_per_s=model / r["time_s"] / 1e12,
                 mfu=(model / r["time_s"] / (peak * 1e12 * n_dev)) if peak else None,
                 xla_over_model=(r["xla_flops"] / model) if r["xla_flops"] and one_pass[name] else None)
        r["peak_memory_mb"], r["memory_kind"] = _peak_memory()
        phases[name] = r

    def step_phase(offline, feats):
        _, fn = cached_train_step(cfg, tcfg, dcfg, offline=offline)

        def thread(out, xs):  # the step donates params / opt_state: pass the returned ones on
            state["params"], state["opt_state"] = out[0], out[1]
            return (out[0], out[1]) + xs[2:]

        xs = (state["params"], state["opt_state"], target.params, st["ids"], st["mask"], st["idx"], epoch, feats, lr)
        return time_fn(fn, xs, thread, warmup=args.warmup, repeats=args.repeats)

    if args.features in ("both", "online"):  # in the table's order: features, draft step, online step
        layer_ids = tuple(dcfg.target_layer_ids)
        feat_fn = jax.jit(lambda tp, ids: jax.lax.map(
            lambda i: objective.target_features(tcfg, tp, i, layer_ids), ids))
        finish("features", time_fn(feat_fn, (target.params, st["ids"]), warmup=args.warmup, repeats=args.repeats),
               flops["target_forward"])
    if args.features in ("both", "offline"):
        width = dcfg.num_features * tcfg.hidden_size
        fshard = None if mesh is None else sharding.batch_sharding(mesh, 4, batch_axis=1)
        feats = jax.jit(lambda k: jax.random.normal(k, (a, b, s, width), resolve_dtype(cfg.dtype)),
                        out_shardings=fshard)(jax.random.PRNGKey(args.seed + 2))
        r = step_phase(True, feats)
        del feats
        finish("draft_step", r, flops["draft_step"])
    if args.features in ("both", "online"):
        finish("online_step", step_phase(False, None), flops["online_step"])

    result = {
        "preset": args.preset, "target": args.target or f"synthetic ({args.preset} dims, random weights)",
        "platform": jax.default_backend(), "device_kind": dev.device_kind, "devices": n_dev, "machine": where,
        "mesh": sharding.mesh_str(mesh) if mesh is not None else "none (one device)",
        "shape": _shape(cfg, dcfg, tcfg),
        "timing": f"median of {args.repeats} calls after {args.warmup} warm-up call(s); compilation excluded "
                  "(compile_s); min_s beside it",
        "peak_tflops": peak, "peak_source": peak_src,
        "model_flops": flops,
        "xla_flops_note": "xla_over_model is null where a loop runs more than once (grad accumulation, several "
                          "lm_head chunks): XLA's cost_analysis counts a loop body once; a Pallas kernel counts 0",
        "phases": phases,
    }
    if "features" in phases and "draft_step" in phases:
        result["split"] = _split(phases)
    return result


def _peak(args, device_kind: str) -> tuple:
    """(peak TFLOP/s per device or None, where it came from)."""
    peak = args.peak_tflops or peak_tflops(device_kind)
    return peak, "--peak-tflops" if args.peak_tflops else (f"table ({device_kind})" if peak else None)


def _shape(cfg, dcfg, tcfg) -> dict:
    """The report's ``shape``: the step's sizes, the models' and the attention impl that runs."""
    a, b, s = cfg.grad_accum, cfg.batch_size, cfg.seq_len
    impl = cfg.impl if cfg.impl != "auto" else ("kernel" if _kernel_ok(dcfg.block_size, dcfg.layers.head_dim)
                                                else "reference")
    return {"seq_len": s, "batch_size": b, "grad_accum": a, "sequences": a * b, "tokens_per_step": a * b * s,
            "num_anchors": cfg.num_anchors, "block_size": dcfg.block_size,
            "draft_layers": dcfg.layers.num_hidden_layers, "target_layers": tcfg.num_hidden_layers,
            "target_layer_ids": list(dcfg.target_layer_ids), "hidden_size": tcfg.hidden_size,
            "vocab_size": tcfg.vocab_size, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "impl": impl}


def _split(phases: dict) -> dict:
    """Offline features + draft step against the online step (both measured)."""
    f_s, d_s = phases["features"]["time_s"], phases["draft_step"]["time_s"]
    return {"features_s": f_s, "draft_step_s": d_s, "sum_s": f_s + d_s,
            "online_step_s": phases["online_step"]["time_s"], "features_over_draft_step": f_s / d_s}


# --- output ------------------------------------------------------------------------------------------


def format_table(r: dict) -> str:
    sh = r["shape"]
    lines = [f"train.bench: {r['target']}",
             f"  {r['platform']} {r['device_kind']} x{r['devices']}, mesh {r['mesh']}, "
             f"{r['machine']['cpu_count']} CPUs, load average {r['machine']['load_average'][0]}",
             f"  S {sh['seq_len']}, {sh['sequences']} sequences/step ({sh['batch_size']} x {sh['grad_accum']} accum), "
             f"{sh['num_anchors']} anchors x block {sh['block_size']}, draft {sh['draft_layers']} layers, target "
             f"{sh['target_layers']} layers (features {sh['target_layer_ids']}), {sh['dtype']}, attention {sh['impl']}",
             f"  {r['timing']}",
             f"{'phase':<12} {'time ms':>10} {'min ms':>10} {'compile s':>9} {'tokens/s':>11} {'model TF':>9} "
             f"{'TFLOP/s':>8} {'MFU':>6} {'XLA/model':>9} {'peak MiB':>9}"]
    for name in PHASES:
        p = r["phases"].get(name)
        if p is None:
            continue
        mfu = f"{p['mfu']:.1%}" if p["mfu"] is not None else "n/a"
        ratio = f"{p['xla_over_model']:.2f}" if p["xla_over_model"] is not None else "n/a"
        lines.append(f"{name:<12} {p['time_s'] * 1e3:>10.2f} {p['min_s'] * 1e3:>10.2f} {p['compile_s']:>9.1f} "
                     f"{p['tokens_per_s']:>11.1f} {p['model_flops'] / 1e12:>9.3g} {p['model_tflops_per_s']:>8.3g} "
                     f"{mfu:>6} {ratio:>9} {p['peak_memory_mb']:>9.0f}")
    if "split" in r:
        sp = r["split"]
        lines.append(f"split: features {sp['features_s'] * 1e3:.2f} ms + draft step {sp['draft_step_s'] * 1e3:.2f} ms "
                     f"= {sp['sum_s'] * 1e3:.2f} ms (online step {sp['online_step_s'] * 1e3:.2f} ms); "
                     f"features / draft step = {sp['features_over_draft_step']:.2f}")
    mem = next(iter(r["phases"].values()))["memory_kind"] if r["phases"] else ""
    lines.append(f"peak memory: {mem}, after each phase (cumulative)")
    lines.append("XLA/model: XLA's cost_analysis() FLOPs over the analytic model FLOPs (n/a where a loop runs more "
                 "than once: XLA counts its body once; it includes elementwise work and the dense reference's masked "
                 "scores; a Pallas kernel counts 0)")
    lines.append(f"MFU: against {r['peak_tflops']} TFLOP/s per device ({r['peak_source']})" if r["peak_tflops"] else
                 "MFU: unavailable (no peak bf16 FLOP/s known for this device; pass --peak-tflops)")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train.bench", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="shape defaults and the synthetic target's dimensions (default: tiny)")
    p.add_argument("--target", default="", help="a real target checkpoint directory instead of the synthetic one "
                   "(the preset then gives only the shape)")
    p.add_argument("--features", choices=["both", "online", "offline"], default="both",
                   help="both: the split (features, draft step) and the online step; online / offline: only those")
    for name in SHAPE_FLAGS:
        kind = str if name == "dtype" else int
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       help="as python -m train (default: the preset's)")
    p.add_argument("--impl", choices=["auto", "kernel", "reference", "interpret"], default="auto",
                   help="draft block attention (default: auto: the Pallas kernel on TPU/GPU, reference on CPU)")
    p.add_argument("--mesh", default="", help="device mesh as python -m train, e.g. data=2,fsdp=2,tensor=2 or auto")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls after compilation (default: 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls; the median is reported (default: 3)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak FLOP/s per device for MFU (TFLOP/s); default: the table for known devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv=None) -> int:
    launch()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} / {args.warmup}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    try:
        result = run(args)
    except BenchError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
