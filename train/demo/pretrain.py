"""Pretrain a small Qwen3-architecture causal LM from scratch with the project's own model code.

Pieces (``train/demo/__main__.py`` chains them into the demo target):
  * ``train_tokenizer``: a byte-level BPE (``tokenizers``) with ``<|endoftext|>`` (EOS and pad) and
    ``<|MASK|>`` (the DFlash mask token), saved as ``tokenizer.json`` + ``tokenizer_config.json``;
  * ``tokenize_files``: one flat uint16 token stream, EOS after every file;
  * ``pretrain``: AdamW (``train/optim.py``: decay on Linear kernels only), linear warmup + cosine to
    10%, global-norm clip 1.0,
    fp32, next-token cross entropy through ``dflash_jax.target.forward`` on packed windows of
    ``seq_len`` tokens. Resumable: every few minutes (and on SIGTERM / Ctrl-C) params, optimizer state
    and the run's metadata go to ``<work>/checkpoint.msgpack``; the batch of a step is a pure function
    of (seed, step), so a restart continues with exactly the batches and learning rates it would have
    seen. Metrics are appended to ``<work>/metrics.jsonl``;
  * ``export_hf`` / ``check_export``: the Hugging Face layout (config.json, bf16 model.safetensors,
    tokenizer) and a check that transformers and ``dj.load_target`` read it to the same logits.

A ``--minutes`` budget (training-loop wall time, summed over restarts) is turned into a step count
from the measured step time and re-planned every few minutes (from the wall time per step of the last
window and of the whole process, evaluations and checkpoints included), so the cosine schedule ends when the budget does
even when other processes slow the machine down or stop doing so. The warmup length is fixed at the
first plan.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from dflash_jax.config import MASK_TOKEN, RopeConfig, TargetConfig
from dflash_jax.target import Target, forward, init_params, save_target
from train.optim import make_optimizer, warmup_cosine
from dflash_jax.progress import progress_bar

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ----------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: Sequence[str], out_dir: str, vocab_size: int = 4096, min_frequency: int = 2,
                    model_max_length: int = 1024) -> str:
    """Train a byte-level BPE on ``texts`` and save it for ``AutoTokenizer.from_pretrained(out_dir)``.

    Byte-level pre-tokenization without a prefix space, so encode -> decode is the identity on any
    text (whitespace and indentation included). Special tokens: ``<|endoftext|>`` = 0 (eos, pad),
    ``<|MASK|>`` = 1 (mask).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN, clean_up_tokenization_spaces=False,
                                   model_max_length=model_max_length)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # transformers 5 writes its own class name; the 4.x name loads in both major versions
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
    return out_dir


def load_tokenizer(tokenizer_dir: str):
    """The raw (fast, Rust) ``tokenizers.Tokenizer`` of a saved tokenizer directory."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))


def tokenize_files(tokenizer_dir: str, texts: Sequence[str]) -> np.ndarray:
    """One uint16 stream: the tokens of every text, each followed by EOS."""
    tok = load_tokenizer(tokenizer_dir)
    eos = tok.token_to_id(EOS_TOKEN)
    if tok.get_vocab_size() > 65536:
        raise ValueError("vocabulary too large for uint16 token storage")
    parts = []
    for enc in tok.encode_batch(list(texts)):
        parts.append(np.asarray(enc.ids, np.uint16))
        parts.append(np.asarray([eos], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


# ----------------------------------------------------------------------------------------------- model

def model_config(vocab_size: int, *, hidden: int = 256, layers: int = 6, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 64, intermediate: int = 768, max_position_embeddings: int = 1024,
                 rope_theta: float = 10000.0, eos_token_id: int = 0, pad_token_id: int = 0) -> TargetConfig:
    """A Qwen3 decoder with tied embeddings (the demo target's family)."""
    return TargetConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=hidden,
                        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                        rope=RopeConfig(theta=rope_theta), eos_token_id=(eos_token_id,),
                        pad_token_id=pad_token_id)


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ----------------------------------------------------------------------------------------------- data

class PackedBatches:
    """Batches of packed windows [batch, seq_len + 1] from one token stream, a pure function of the step.

    Epoch e shuffles the non-overlapping windows (start = offset_e + k * seq_len, offset_e random in
    [0, seq_len)) with ``np.random.default_rng([seed, e])``; global window g = step * batch + row.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.windows_per_epoch = (len(tokens) - 1 - seq_len) // seq_len
        if self.windows_per_epoch < 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of {seq_len}")
        self._epoch = None

    def _order(self, epoch: int):
        if self._epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_len))
            self._cached = offset, rng.permutation(self.windows_per_epoch)
            self._epoch = epoch
        return self._cached

    def batch(self, step: int) -> np.ndarray:
        rows = []
        for g in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, k = divmod(g, self.windows_per_epoch)
            offset, perm = self._order(epoch)
            start = offset + int(perm[k]) * self.seq_len
            rows.append(self.tokens[start:start + self.seq_len + 1])
        return np.stack(rows).astype(np.int32)

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.windows_per_epoch


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Fixed evaluation windows [n, seq_len + 1]: non-overlapping, evenly spread when capped."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} held-out tokens are too few for windows of {seq_len}")
    idx = np.arange(n) if not max_windows or max_windows >= n else np.linspace(0, n - 1, max_windows).round()
    return np.stack([tokens[int(i) * seq_len:int(i) * seq_len + seq_len + 1] for i in idx]).astype(np.int32)


# ----------------------------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class TrainHParams:
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 60           # steps between held-out evaluations
    eval_windows: int = 48         # windows of the periodic held-out evaluation (the final one uses all)
    log_every: int = 10            # steps between train-metric lines in metrics.jsonl
    save_minutes: float = 3.0      # wall-clock minutes between checkpoints

    @property
    def opt_hp(self):
        """``train.optim.make_optimizer``'s arguments."""
        return (self.clip, self.b1, self.b2, self.weight_decay)


def warmup_for(total: int, hp: TrainHParams) -> int:
    return max(1, min(hp.warmup_steps, total // 10))


def lr_at(step: int, total: int, hp: TrainHParams, warmup: int | None = None) -> float:
    """Linear warmup (default min(warmup_steps, total/10) steps), then cosine from lr to lr * min_lr_ratio."""
    warmup = warmup_for(total, hp) if warmup is None else warmup
    return warmup_cosine(step, peak=hp.lr, warmup=warmup, cosine_steps=total - warmup, final_frac=hp.min_lr_ratio)


def _loss(cfg: TargetConfig, params, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
    logits, _, _ = forward(cfg, params, x, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


@functools.partial(jax.jit, static_argnames=("cfg", "opt_hp"), donate_argnums=(2, 3))
def train_step(cfg: TargetConfig, opt_hp: tuple, params, opt_state, tokens, lr):
    """One AdamW step on tokens [B, S+1]; returns (params, opt_state, mean loss, grad norm before clipping)."""
    loss, grads = jax.value_and_grad(lambda p: _loss(cfg, p, tokens).mean())(params)
    updates, opt_state = make_optimizer(*opt_hp).update(grads, opt_state, params)
    params = jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)
    return params, opt_state, loss, optax.tree.norm(grads)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eval_rows(cfg: TargetConfig, params, tokens):
    return _loss(cfg, params, tokens).sum(axis=1)


def evaluate(cfg: TargetConfig, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean next-token cross entropy (nats) over all tokens of ``windows`` [n, S+1]."""
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        n = len(chunk)
        if n < batch_size:  # keep one compiled shape: pad with copies, count only the real rows
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - n, axis=0)])
        total += float(np.asarray(_eval_rows(cfg, params, jnp.asarray(chunk)))[:n].sum())
    return total / (windows.shape[0] * (windows.shape[1] - 1))


# ----------------------------------------------------------------------------------------------- checkpoints

CHECKPOINT = "checkpoint.msgpack"
METRICS = "metrics.jsonl"


def save_checkpoint(work_dir: str, params, opt_state, meta: dict) -> None:
    """Atomically write params + optimizer state + metadata (json) to ``<work_dir>/checkpoint.msgpack``."""
    state = {"params": serialization.to_state_dict(jax.device_get(params)),
             "opt_state": serialization.to_state_dict(jax.device_get(opt_state)),
             "meta": json.dumps(meta)}
    path = os.path.join(work_dir, CHECKPOINT)
    with open(path + ".tmp", "wb") as f:
        f.write(serialization.msgpack_serialize(state))
    os.replace(path + ".tmp", path)


def load_checkpoint(work_dir: str, params_template, opt_template):
    """(params, opt_state, meta) from ``<work_dir>/checkpoint.msgpack``, or None when there is none."""
    path = os.path.join(work_dir, CHECKPOINT)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        state = serialization.msgpack_restore(f.read())
    params = serialization.from_state_dict(params_template, state["params"])
    opt_state = serialization.from_state_dict(opt_template, state["opt_state"])
    to_device = functools.partial(jax.tree_util.tree_map, jnp.asarray)
    return to_device(params), to_device(opt_state), json.loads(state["meta"])


class _StopFlag:
    """SIGTERM -> finish the current step, checkpoint, return (Ctrl-C is caught the same way)."""

    def __init__(self):
        self.stop = False

    def __enter__(self):
        self._old = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, *_):
        self.stop = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def pretrain(cfg: TargetConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray, work_dir: str, *,
             hp: TrainHParams = TrainHParams(), steps: int | None = None, minutes: float | None = None,
             progress: bool = True, log: Callable[[str], None] | None = None,
             interrupt_at: int | None = None, replan_seconds: float = 180.0) -> tuple:
    """Train (or resume) in ``work_dir``; returns (params, summary dict).

    Stops after ``steps`` steps, or when ``minutes`` of training-loop wall time (summed over restarts)
    are spent; with only ``minutes`` the step count is planned from the measured step time. A run
    whose checkpoint says it finished returns at once. ``interrupt_at`` (for tests) acts as if SIGTERM
    arrived during that step: checkpoint, return with ``summary["stopped"]`` set.
    """
    if steps is None and minutes is None:
        raise ValueError("give steps, minutes or both")
    from tqdm.auto import tqdm

    os.makedirs(work_dir, exist_ok=True)
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))
    metrics_path = os.path.join(work_dir, METRICS)
    data = PackedBatches(train_tokens, hp.seq_len, hp.batch_size, hp.seed)
    periodic_eval = eval_windows(heldout_tokens, hp.seq_len, hp.eval_windows)
    run_key = {"model": cfg.to_hf(), "hparams": dataclasses.asdict(hp), "train_tokens": int(len(train_tokens)),
               "heldout_tokens": int(len(heldout_tokens))}

    params = init_params(cfg, hp.seed)
    opt_state = make_optimizer(*hp.opt_hp).init(params)
    restored = load_checkpoint(work_dir, params, opt_state)
    if restored is not None:
        params, opt_state, meta = restored
        if meta["run_key"] != run_key:
            raise ValueError(f"{work_dir} holds a run with different settings (model, hyperparameters or "
                             "data); use another work directory or delete it")
        log(f"resumed from {work_dir}/{CHECKPOINT} at step {meta['step']} "
            f"({meta['elapsed_s'] / 60:.1f} min trained so far)")
    else:
        meta = {"run_key": run_key, "step": 0, "total_steps": steps, "elapsed_s": 0.0, "tokens_seen": 0,
                "finished": False, "planned": steps is not None, "heldout_loss": None}
    n_params = count_params(params)
    budget_s = None if minutes is None else minutes * 60.0
    if meta["finished"]:
        more_steps = steps is not None and steps > meta["step"]
        prev_minutes = meta.get("minutes") or meta["elapsed_s"] / 60 + 5  # (older checkpoints lack it)
        more_time = budget_s is not None and minutes > prev_minutes and budget_s > meta["elapsed_s"] + 60
        if not (more_steps or more_time):
            log(f"run in {work_dir} already finished at step {meta['step']}")
            return params, {**meta, "params": n_params}
        # a larger budget than the finished run had: continue it (the cosine is re-planned over the
        # longer run, so the learning rate rises again from its final value: a warm restart)
        meta["finished"] = False
        if steps is None:
            per_step = meta["elapsed_s"] / max(1, meta["step"])
            meta["total_steps"] = meta["step"] + max(1, int(0.97 * (budget_s - meta["elapsed_s"]) / per_step))
        log(f"extending the finished run from step {meta['step']} to {steps or meta['total_steps']} steps")
    if steps is not None:
        meta["total_steps"], meta["planned"] = steps, True
    meta["minutes"] = minutes
    provisional = 10 ** 9  # until the step time is measured (warmup does not depend on it)

    def save():
        save_checkpoint(work_dir, params, opt_state, meta)

    def write_metrics(row):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    tokens_per_step = hp.batch_size * hp.seq_len
    step = meta["step"]
    pbar = progress_bar(meta["total_steps"] or None, "pretrain", "step", progress, initial=step,
                        mininterval=1.0 if sys.stderr.isatty() else 30.0)
    t_loop = time.time()
    elapsed0 = meta["elapsed_s"]
    last_save = time.time()
    first_step = step
    timed = []  # wall time of recent steps (after the first, compiling one)
    window_t, window_step = time.time(), step
    loss_acc, gn_acc, n_acc = 0.0, 0.0, 0
    reason = None
    with _StopFlag() as flag:
        try:
            while True:
                total = meta["total_steps"] or provisional
                if step >= total:
                    reason = "steps"
                    break
                if budget_s is not None and elapsed0 + time.time() - t_loop >= budget_s:
                    reason = "minutes"
                    break
                if flag.stop:
                    reason = "signal"
                    break
                t0 = time.time()
                if meta["planned"] and not meta.get("warmup"):
                    meta["warmup"] = warmup_for(meta["total_steps"], hp)
                lr = lr_at(step, total, hp, meta.get("warmup"))
                batch = jnp.asarray(data.batch(step))
                params, opt_state, loss, gnorm = train_step(cfg, hp.opt_hp, params, opt_state, batch,
                                                            jnp.float32(lr))
                loss, gnorm = float(loss), float(gnorm)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {step}")
                step += 1
                dt = time.time() - t0
                if step > first_step + 1:  # the first step of a process compiles
                    timed.append(dt)
                timed = timed[-20:]
                meta["step"], meta["tokens_seen"] = step, meta["tokens_seen"] + tokens_per_step
                meta["elapsed_s"] = elapsed0 + time.time() - t_loop
                loss_acc, gn_acc, n_acc = loss_acc + loss, gn_acc + gnorm, n_acc + 1
                tok_s = tokens_per_step / (sum(timed) / len(timed)) if timed else float("nan")
                pbar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}", refresh=False)
                pbar.update(1)
                if interrupt_at is not None and step >= interrupt_at:
                    flag.stop = True

                if not meta["planned"] and len(timed) >= 5:
                    remaining = budget_s - meta["elapsed_s"]
                    meta["total_steps"] = step + max(1, int(0.97 * remaining / (sum(timed) / len(timed))))
                    meta["planned"] = True
                    meta["warmup"] = warmup_for(meta["total_steps"], hp)
                    pbar.total = meta["total_steps"]
                    log(f"planned {meta['total_steps']} steps for {minutes:g} min "
                        f"({sum(timed) / len(timed):.2f} s/step, {tok_s:.0f} tokens/s)")
                if step % hp.log_every == 0 or step == meta["total_steps"]:
                    write_metrics({"kind": "train", "step": step, "loss": loss_acc / n_acc, "lr": lr,
                                   "grad_norm": gn_acc / n_acc, "tokens": meta["tokens_seen"],
                                   "epoch": round(data.epoch_of(step), 4), "tokens_per_s": round(tok_s, 1) if math.isfinite(tok_s) else None,
                                   "elapsed_s": round(meta["elapsed_s"], 1)})
                    loss_acc, gn_acc, n_acc = 0.0, 0.0, 0
                if step % hp.eval_every == 0:
                    ho = evaluate(cfg, params, periodic_eval, hp.batch_size)
                    meta["heldout_loss"] = ho
                    write_metrics({"kind": "eval", "step": step, "heldout_loss": ho, "tokens": meta["tokens_seen"],
                                   "elapsed_s": round(elapsed0 + time.time() - t_loop, 1)})
                    log(f"step {step}: train loss {loss:.3f}, held-out loss {ho:.3f} "
                        f"(ppl {math.exp(ho):.1f}), {meta['tokens_seen'] / 1e6:.2f}M tokens, "
                        f"{(elapsed0 + time.time() - t_loop) / 60:.1f} min")
                now = time.time()
                if budget_s is not None and meta["planned"] and steps is None and now - window_t >= replan_seconds:
                    # re-plan when the budget and the steps left drifted apart; the time per step is the
                    # mean of the last window's and this process's (damps bursts of load from others)
                    recent = (now - window_t) / max(1, step - window_step)
                    per_step = 0.5 * recent + 0.5 * (now - t_loop) / max(1, step - first_step)
                    remaining = budget_s - (elapsed0 + now - t_loop)
                    need = (meta["total_steps"] - step) * per_step
                    if remaining > 0 and not 0.9 * remaining <= need <= 1.08 * remaining:
                        new_total = step + max(1, int(0.99 * remaining / per_step))
                        log(f"re-planned total steps {meta['total_steps']} -> {new_total} ({recent:.2f} s/step "
                            f"over the last {(now - window_t) / 60:.1f} min, {per_step:.2f} s/step planned)")
                        meta["total_steps"] = new_total
                        pbar.total = new_total
                    window_t, window_step = now, step
                if time.time() - last_save >= hp.save_minutes * 60:
                    save()
                    last_save = time.time()
        except KeyboardInterrupt:
            reason = "interrupt"
        finally:
            pbar.close()
            meta["elapsed_s"] = elapsed0 + time.time() - t_loop
            if reason is not None:
                save()
    if reason in ("signal", "interrupt"):
        log(f"stopped by {reason} at step {step}; checkpoint saved, rerun to continue")
        return params, {**meta, "params": n_params, "stopped": reason}
    full = eval_windows(heldout_tokens, hp.seq_len)
    meta["heldout_loss"] = evaluate(cfg, params, full, hp.batch_size)
    meta["finished"], meta["finish_reason"] = True, reason
    write_metrics({"kind": "final", "step": step, "heldout_loss": meta["heldout_loss"],
                   "heldout_tokens": int(full.shape[0] * hp.seq_len), "tokens": meta["tokens_seen"],
                   "elapsed_s": round(meta["elapsed_s"], 1), "reason": reason})
    save()
    log(f"finished ({reason}) at step {step}: held-out loss {meta['heldout_loss']:.4f} on all "
        f"{full.shape[0]} held-out windows, {meta['tokens_seen'] / 1e6:.2f}M tokens seen")
    return params, {**meta, "params": n_params}


# ----------------------------------------------------------------------------------------------- export

def export_hf(cfg: TargetConfig, params, out_dir: str, tokenizer_dir: str, summary: dict | None = None,
              dtype: str = "bfloat16") -> str:
    """Write the Hugging Face layout: config.json, model.safetensors (``dtype``), tokenizer files,
    generation_config.json and (when given) ``training.json`` with the run summary."""
    save_target(Target(cfg, params), out_dir, dtype)
    eos = cfg.eos_token_id[0] if cfg.eos_token_id else None
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "pad_token_id": cfg.pad_token_id, "do_sample": False}, f, indent=2)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
    if summary is not None:
        with open(os.path.join(out_dir, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return out_dir


def check_export(out_dir: str, text: str, max_tokens: int = 128, compare_torch: bool = True) -> dict:
    """Reload ``out_dir`` with transformers and ``dj.load_target``: tokenizer round trip, eos, logits.

    Returns {"roundtrip": bool, "eos_token": str, "max_abs_logit_diff": float or None, ...}; raises
    AssertionError when the tokenizer does not round-trip or the logits disagree (> 1e-3 absolute).
    """
    import dflash_jax as dj
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    ids = tok(text)["input_ids"]
    roundtrip = tok.decode(ids) == text
    assert roundtrip, "tokenizer does not round-trip the text"
    assert tok.eos_token == EOS_TOKEN and tok.mask_token == MASK_TOKEN, (tok.eos_token, tok.mask_token)
    out = {"roundtrip": roundtrip, "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
           "mask_token_id": tok.mask_token_id, "max_abs_logit_diff": None}
    ids = np.asarray(ids[:max_tokens], np.int32)[None]
    target = dj.load_target(out_dir, dtype="float32")
    ours = dj.target_logits(target, ids)
    if compare_torch:
        import torch
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
        diff = float(np.abs(theirs - ours).max())
        out["max_abs_logit_diff"] = diff
        out["argmax_agreement"] = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
        assert diff < 1e-3, f"transformers and dj.load_target logits differ by {diff}"
    return out
