"""Pretrain a small Qwen3-architecture causal LM from scratch with the project's own model code.

Pieces (``train/demo_recipe/__main__.py`` chains them into the demo target):
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

from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.drafts.config import MASK_TOKEN
from dflash_jax.target import Target, forward, init_params, save_target
from train.optim import make_optimizer, warmup_cosine
from dflash_jax.progress import progress_bar

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The demo's chat template: a code model, so a conversation is written as comments and the answer continues after
# the assistant's; it lets the server's chat route (and --chat) run on the demo pair.
CHAT_TEMPLATE = ("{%- for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{%- if add_generation_prompt %}# assistant:\n{% endif %}")


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
    tok_cfg["chat_template"] = CHAT_TEMPLATE
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


def _restore_or_start(cfg: TargetConfig, hp: TrainHParams, work_dir: str, run_key: dict, steps: int | None, log):
    """(params, opt_state, meta): the checkpoint's state (refused when its run had other settings), or a fresh
    one."""
    params = init_params(cfg, hp.seed)
    opt_state = make_optimizer(*hp.opt_hp).init(params)
    restored = load_checkpoint(work_dir, params, opt_state)
    if restored is None:
        return params, opt_state, {"run_key": run_key, "step": 0, "total_steps": steps, "elapsed_s": 0.0,
                                   "tokens_seen": 0, "finished": False, "planned": steps is not None,
                                   "heldout_loss": None}
    params, opt_state, meta = restored
    if meta["run_key"] != run_key:
        raise ValueError(f"{work_dir} holds a run with different settings (model, hyperparameters or "
                         "data); use another work directory or delete it")
    log(f"resumed from {work_dir}/{CHECKPOINT} at step {meta['step']} "
        f"({meta['elapsed_s'] / 60:.1f} min trained so far)")
    return params, opt_state, meta


def _reopen_finished(meta: dict, steps: int | None, minutes: float | None, work_dir: str, log) -> bool:
    """A finished run given more steps or a larger budget than it had: reopen it (True); else False."""
    budget_s = None if minutes is None else minutes * 60.0
    more_steps = steps is not None and steps > meta["step"]
    prev_minutes = meta.get("minutes") or meta["elapsed_s"] / 60 + 5  # (older checkpoints lack it)
    more_time = budget_s is not None and minutes > prev_minutes and budget_s > meta["elapsed_s"] + 60
    if not (more_steps or more_time):
        log(f"run in {work_dir} already finished at step {meta['step']}")
        return False
    # a larger budget than the finished run had: continue it (the cosine is re-planned over the
    # longer run, so the learning rate rises again from its final value: a warm restart)
    meta["finished"] = False
    if steps is None:
        per_step = meta["elapsed_s"] / max(1, meta["step"])
        meta["total_steps"] = meta["step"] + max(1, int(0.97 * (budget_s - meta["elapsed_s"]) / per_step))
    log(f"extending the finished run from step {meta['step']} to {steps or meta['total_steps']} steps")
    return True


class _PretrainLoop:
    """The step loop of ``pretrain`` and its bookkeeping: timing, planning the step count from a budget,
    metrics, evaluations and checkpoints (``meta`` is what the checkpoint keeps)."""

    PROVISIONAL = 10 ** 9  # the step count until the step time is measured (warmup does not depend on it)

    def __init__(self, cfg: TargetConfig, hp: TrainHParams, state: tuple, *, data, periodic_eval, work_dir: str,
                 steps: int | None, minutes: float | None, progress: bool, log, replan_seconds: float):
        self.cfg, self.hp, self.data, self.periodic_eval, self.work_dir = cfg, hp, data, periodic_eval, work_dir
        self.params, self.opt_state, self.meta = state
        self.steps, self.minutes, self.log, self.replan_seconds = steps, minutes, log, replan_seconds
        self.budget_s = None if minutes is None else minutes * 60.0
        self.metrics_path = os.path.join(work_dir, METRICS)
        self.tokens_per_step = hp.batch_size * hp.seq_len
        self.step = self.first_step = self.window_step = self.meta["step"]
        self.pbar = progress_bar(self.meta["total_steps"] or None, "pretrain", "step", progress, initial=self.step,
                                 mininterval=1.0 if sys.stderr.isatty() else 30.0)
        self.t_loop = self.last_save = self.window_t = time.time()
        self.elapsed0 = self.meta["elapsed_s"]
        self.timed = []  # wall time of recent steps (after the first, compiling one)
        self.loss_acc, self.gn_acc, self.n_acc = 0.0, 0.0, 0

    def save(self) -> None:
        save_checkpoint(self.work_dir, self.params, self.opt_state, self.meta)

    def write_metrics(self, row: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def stop_reason(self, flag: _StopFlag) -> str | None:
        if self.step >= (self.meta["total_steps"] or self.PROVISIONAL):
            return "steps"
        if self.budget_s is not None and self.elapsed0 + time.time() - self.t_loop >= self.budget_s:
            return "minutes"
        return "signal" if flag.stop else None

    def one_step(self) -> tuple[float, float, float]:
        """One optimizer step and its bookkeeping: (loss, lr, tokens/s of the recent steps)."""
        meta, hp = self.meta, self.hp
        t0 = time.time()
        if meta["planned"] and not meta.get("warmup"):
            meta["warmup"] = warmup_for(meta["total_steps"], hp)
        lr = lr_at(self.step, meta["total_steps"] or self.PROVISIONAL, hp, meta.get("warmup"))
        batch = jnp.asarray(self.data.batch(self.step))
        self.params, self.opt_state, loss, gnorm = train_step(self.cfg, hp.opt_hp, self.params, self.opt_state,
                                                              batch, jnp.float32(lr))
        loss, gnorm = float(loss), float(gnorm)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.step}")
        self.step += 1
        dt = time.time() - t0
        if self.step > self.first_step + 1:  # the first step of a process compiles
            self.timed.append(dt)
        self.timed = self.timed[-20:]
        meta["step"], meta["tokens_seen"] = self.step, meta["tokens_seen"] + self.tokens_per_step
        meta["elapsed_s"] = self.elapsed0 + time.time() - self.t_loop
        self.loss_acc, self.gn_acc, self.n_acc = self.loss_acc + loss, self.gn_acc + gnorm, self.n_acc + 1
        tok_s = self.tokens_per_step / (sum(self.timed) / len(self.timed)) if self.timed else float("nan")
        self.pbar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}", refresh=False)
        self.pbar.update(1)
        return loss, lr, tok_s

    def plan(self, tok_s: float) -> None:
        """With only a budget: the step count from the first measured step times (once)."""
        meta, timed = self.meta, self.timed
        if meta["planned"] or len(timed) < 5:
            return
        remaining = self.budget_s - meta["elapsed_s"]
        meta["total_steps"] = self.step + max(1, int(0.97 * remaining / (sum(timed) / len(timed))))
        meta["planned"] = True
        meta["warmup"] = warmup_for(meta["total_steps"], self.hp)
        self.pbar.total = meta["total_steps"]
        self.log(f"planned {meta['total_steps']} steps for {self.minutes:g} min "
                 f"({sum(timed) / len(timed):.2f} s/step, {tok_s:.0f} tokens/s)")

    def record(self, loss: float, lr: float, tok_s: float) -> None:
        """The metrics row every --log-every steps and the held-out evaluation every eval_every steps."""
        meta, hp, step = self.meta, self.hp, self.step
        if step % hp.log_every == 0 or step == meta["total_steps"]:
            self.write_metrics({"kind": "train", "step": step, "loss": self.loss_acc / self.n_acc, "lr": lr,
                                "grad_norm": self.gn_acc / self.n_acc, "tokens": meta["tokens_seen"],
                                "epoch": round(self.data.epoch_of(step), 4),
                                "tokens_per_s": round(tok_s, 1) if math.isfinite(tok_s) else None,
                                "elapsed_s": round(meta["elapsed_s"], 1)})
            self.loss_acc, self.gn_acc, self.n_acc = 0.0, 0.0, 0
        if step % hp.eval_every == 0:
            ho = evaluate(self.cfg, self.params, self.periodic_eval, hp.batch_size)
            meta["heldout_loss"] = ho
            self.write_metrics({"kind": "eval", "step": step, "heldout_loss": ho, "tokens": meta["tokens_seen"],
                                "elapsed_s": round(self.elapsed0 + time.time() - self.t_loop, 1)})
            self.log(f"step {step}: train loss {loss:.3f}, held-out loss {ho:.3f} "
                     f"(ppl {math.exp(ho):.1f}), {meta['tokens_seen'] / 1e6:.2f}M tokens, "
                     f"{(self.elapsed0 + time.time() - self.t_loop) / 60:.1f} min")

    def replan(self) -> None:
        """Every ``replan_seconds`` of a budgeted run: re-plan when the budget and the steps left drifted apart;
        the time per step is the mean of the last window's and this process's (damps bursts of load)."""
        now, meta = time.time(), self.meta
        if not (self.budget_s is not None and meta["planned"] and self.steps is None
                and now - self.window_t >= self.replan_seconds):
            return
        recent = (now - self.window_t) / max(1, self.step - self.window_step)
        per_step = 0.5 * recent + 0.5 * (now - self.t_loop) / max(1, self.step - self.first_step)
        remaining = self.budget_s - (self.elapsed0 + now - self.t_loop)
        need = (meta["total_steps"] - self.step) * per_step
        if remaining > 0 and not 0.9 * remaining <= need <= 1.08 * remaining:
            new_total = self.step + max(1, int(0.99 * remaining / per_step))
            self.log(f"re-planned total steps {meta['total_steps']} -> {new_total} ({recent:.2f} s/step "
                     f"over the last {(now - self.window_t) / 60:.1f} min, {per_step:.2f} s/step planned)")
            meta["total_steps"] = new_total
            self.pbar.total = new_total
        self.window_t, self.window_step = now, self.step

    def run(self, interrupt_at: int | None) -> str:
        """Steps until the step count, the budget, SIGTERM or Ctrl-C; checkpointed on the way out. The reason."""
        reason = None
        with _StopFlag() as flag:
            try:
                while (reason := self.stop_reason(flag)) is None:
                    loss, lr, tok_s = self.one_step()
                    if interrupt_at is not None and self.step >= interrupt_at:
                        flag.stop = True
                    self.plan(tok_s)
                    self.record(loss, lr, tok_s)
                    self.replan()
                    if time.time() - self.last_save >= self.hp.save_minutes * 60:
                        self.save()
                        self.last_save = time.time()
            except KeyboardInterrupt:
                reason = "interrupt"
            finally:
                self.pbar.close()
                self.meta["elapsed_s"] = self.elapsed0 + time.time() - self.t_loop
                if reason is not None:
                    self.save()
        return reason

    def finish(self, reason: str, heldout_tokens: np.ndarray) -> None:
        """The finished run: held-out loss on every window, the final metrics row and checkpoint."""
        meta, hp = self.meta, self.hp
        full = eval_windows(heldout_tokens, hp.seq_len)
        meta["heldout_loss"] = evaluate(self.cfg, self.params, full, hp.batch_size)
        meta["finished"], meta["finish_reason"] = True, reason
        self.write_metrics({"kind": "final", "step": self.step, "heldout_loss": meta["heldout_loss"],
                            "heldout_tokens": int(full.shape[0] * hp.seq_len), "tokens": meta["tokens_seen"],
                            "elapsed_s": round(meta["elapsed_s"], 1), "reason": reason})
        self.save()
        self.log(f"finished ({reason}) at step {self.step}: held-out loss {meta['heldout_loss']:.4f} on all "
                 f"{full.shape[0]} held-out windows, {meta['tokens_seen'] / 1e6:.2f}M tokens seen")


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
    data = PackedBatches(train_tokens, hp.seq_len, hp.batch_size, hp.seed)
    periodic_eval = eval_windows(heldout_tokens, hp.seq_len, hp.eval_windows)
    run_key = {"model": cfg.to_hf(), "hparams": dataclasses.asdict(hp), "train_tokens": int(len(train_tokens)),
               "heldout_tokens": int(len(heldout_tokens))}
    params, opt_state, meta = _restore_or_start(cfg, hp, work_dir, run_key, steps, log)
    n_params = count_params(params)
    if meta["finished"] and not _reopen_finished(meta, steps, minutes, work_dir, log):
        return params, {**meta, "params": n_params}
    if steps is not None:
        meta["total_steps"], meta["planned"] = steps, True
    meta["minutes"] = minutes
    loop = _PretrainLoop(cfg, hp, (params, opt_state, meta), data=data, periodic_eval=periodic_eval,
                         work_dir=work_dir, steps=steps, minutes=minutes, progress=progress, log=log,
                         replan_seconds=replan_seconds)
    reason = loop.run(interrupt_at)
    if reason in ("signal", "interrupt"):
        log(f"stopped by {reason} at step {loop.step}; checkpoint saved, rerun to continue")
        return loop.params, {**meta, "params": n_params, "stopped": reason}
    loop.finish(reason, heldout_tokens)
    return loop.params, {**meta, "params": n_params}


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
