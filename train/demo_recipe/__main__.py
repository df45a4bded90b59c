"""Reproduce the embedded demo pair, one stage per subcommand.

  python -m train.demo_recipe target [--minutes 45] [--out DIR] [--work DIR]

``target``: the demo target model, end to end on the CPU:
  1. corpus: the Python standard library (``dflash_jax/demo/corpus.py``: test code and data modules excluded,
     a fixed ~5% of the modules held out);
  2. a byte-level BPE tokenizer (vocab 4096, ``<|endoftext|>`` = EOS/pad, ``<|MASK|>`` = mask) trained
     on the training modules;
  3. pretraining of a Qwen3-architecture model from scratch (``train/demo_recipe/pretrain.py``), resumable:
     rerunning the same command continues from the last checkpoint in the work directory;
  4. export in the Hugging Face layout (config.json, bf16 model.safetensors, tokenizer files,
     training.json) to ``--out`` (default ``runs/demo/target/export``) and a reload check with transformers
     and ``dj.load_target``.
Work files (tokenizer, token streams, checkpoint, metrics.jsonl) live in ``runs/demo/target/``.

  python -m train.demo_recipe draft [--steps 650] [--target DIR] [--out DIR] [--work DIR] [--init-draft DIR]

``draft``: a block-16 DFlash draft for the demo target with the project's training pipeline:
  1. prompts cut from the TRAINING modules at def/class lines (``corpus.code_prompts``), and held-out
     prompts for evaluation;
  2. the target answers them greedily (``train.make_data``, batched through the decode engine);
  3. ``train.loop.train`` with cached target features (``--cache-features``);
  4. export in the released layout (bf16) to ``--out`` (default ``runs/demo/draft/export``).
Every step resumes: rerunning skips finished data shards and continues from the last checkpoint.
Replacing the pair the package ships (``dflash_jax/demo/``) takes ``--out`` naming it and ``--replace-shipped``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

import numpy as np

from dflash_jax.demo import DEMO_DRAFT, DEMO_TARGET
from dflash_jax.launch import launch

DEFAULT_WORK = os.path.join("runs", "demo")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prepare_data(work: str, vocab_size: int, log=_log):
    """Tokenizer + token streams in ``work`` (reused when present); returns (tokenizer_dir, train, heldout)."""
    from dflash_jax.demo import corpus
    from train.demo_recipe.pretrain import tokenize_files, train_tokenizer

    train_files, heldout_files = corpus.train_files(), corpus.heldout_files()
    train_texts = [corpus.read_text(f) for f in train_files]
    heldout_texts = [corpus.read_text(f) for f in heldout_files]
    log(f"corpus: {corpus.stdlib_dir()} (Python {platform.python_version()}): {len(train_files)} train modules "
        f"({sum(map(len, train_texts)) / 1e6:.2f}M chars), {len(heldout_files)} held-out modules "
        f"({sum(map(len, heldout_texts)) / 1e6:.2f}M chars)")
    tok_dir = os.path.join(work, "tokenizer")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        t = time.time()
        train_tokenizer(train_texts, tok_dir, vocab_size=vocab_size)
        log(f"trained the tokenizer (vocab {vocab_size}) in {time.time() - t:.0f}s -> {tok_dir}")
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        have = len(json.load(f)["model"]["vocab"])
    if have != vocab_size:
        raise SystemExit(f"{tok_dir} has a vocabulary of {have}, not {vocab_size}; use another --work")
    key = {"tokenizer": _sha(os.path.join(tok_dir, "tokenizer.json")),
           "train_files": len(train_files), "heldout_files": len(heldout_files),
           "train_chars": sum(map(len, train_texts)), "heldout_chars": sum(map(len, heldout_texts))}
    meta_path = os.path.join(work, "tokens.json")
    paths = {s: os.path.join(work, f"tokens_{s}.npy") for s in ("train", "heldout")}
    have_key = json.load(open(meta_path)) if os.path.isfile(meta_path) else None
    if have_key != key or not all(os.path.isfile(p) for p in paths.values()):
        t = time.time()
        for split, texts in (("train", train_texts), ("heldout", heldout_texts)):
            np.save(paths[split], tokenize_files(tok_dir, texts))
        with open(meta_path, "w") as f:
            json.dump(key, f)
        log(f"tokenized the corpus in {time.time() - t:.0f}s")
    train, heldout = np.load(paths["train"]), np.load(paths["heldout"])
    log(f"tokens: {len(train) / 1e6:.2f}M train, {len(heldout) / 1e3:.0f}K held-out "
        f"({key['heldout_chars'] / len(heldout):.2f} chars/token)")
    return tok_dir, train, heldout, key


def _out_dir(args, stage: str) -> str | None:
    """Where ``stage`` exports: ``--out``, or WORK/STAGE/export; None (after saying why) when it names a
    directory of the shipped demo pair without --replace-shipped."""
    out = args.out or os.path.join(args.work, stage, "export")
    shipped = [d for d in (DEMO_TARGET, DEMO_DRAFT) if os.path.realpath(out) == os.path.realpath(d)]
    if shipped and not args.replace_shipped:
        _log(f"--out {out} is the demo pair the package ships ({shipped[0]}): pass --replace-shipped to "
             "overwrite it, or another --out")
        return None
    return out


def cmd_target(args) -> int:
    import jax

    from dflash_jax.demo import corpus
    from train.demo_recipe.pretrain import TrainHParams, check_export, count_params, export_hf, model_config, pretrain

    out = _out_dir(args, "target")
    if out is None:
        return 2
    work = os.path.join(args.work, "target")
    os.makedirs(work, exist_ok=True)
    minutes = args.minutes if (args.minutes is not None or args.steps is not None) else 45.0
    tok_dir, train, heldout, data_key = prepare_data(work, args.vocab_size)
    cfg = model_config(args.vocab_size, hidden=args.hidden, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                       max_position_embeddings=max(1024, 2 * args.seq_len))
    hp = TrainHParams(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                      eval_windows=args.eval_windows, save_minutes=args.save_minutes)
    _log(f"model: Qwen3, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
         f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} x {cfg.head_dim}, mlp {cfg.intermediate_size}, "
         f"vocab {cfg.vocab_size}, tied; batch {hp.batch_size} x {hp.seq_len} tokens; "
         f"{'%g min' % minutes if minutes else ''}{' / ' if minutes and args.steps else ''}"
         f"{'%d steps' % args.steps if args.steps else ''}; jax {jax.__version__} on {jax.default_backend()}")
    params, summary = pretrain(cfg, train, heldout, work, hp=hp, steps=args.steps, minutes=minutes,
                               progress=not args.no_progress)
    if summary.get("stopped"):
        return 130
    summary = {
        "model": "demo target: Qwen3 architecture pretrained from scratch on the Python standard library",
        "reproduce": "python -m train.demo_recipe target" + (f" --minutes {minutes:g}" if minutes else "")
                     + (f" --steps {args.steps}" if args.steps else ""),
        "params": count_params(params),
        "steps": summary["step"], "tokens_seen": summary["tokens_seen"],
        "train_minutes": round(summary["elapsed_s"] / 60, 1),
        "heldout_loss": summary["heldout_loss"],
        "heldout_chars_per_token": round(data_key["heldout_chars"] / len(heldout), 3),
        "heldout_bits_per_char": summary["heldout_loss"] / np.log(2) / (data_key["heldout_chars"] / len(heldout)),
        "seq_len": hp.seq_len, "batch_size": hp.batch_size, "lr": hp.lr,
        "corpus": {"python": platform.python_version(), "train_modules": data_key["train_files"],
                   "heldout_modules": data_key["heldout_files"], "train_tokens": int(len(train)),
                   "heldout_tokens": int(len(heldout)),
                   "heldout_rule": "int(sha1(path relative to the stdlib).hexdigest(), 16) % 20 == 0"},
    }
    export_hf(cfg, params, out, tok_dir, summary)
    _log(f"exported to {out}: " + ", ".join(f"{n} {os.path.getsize(os.path.join(out, n)) / 1e6:.2f} MB"
                                             for n in sorted(os.listdir(out))))
    if not args.no_check:
        text = corpus.read_text(corpus.heldout_files()[0])[:2000]
        check = check_export(out, text, compare_torch=True)
        _log(f"reload check: tokenizer round-trips, eos {check['eos_token']!r} = {check['eos_token_id']}, "
             f"mask = {check['mask_token_id']}; transformers vs dj.load_target logits max |diff| "
             f"{check['max_abs_logit_diff']:.2e}, argmax agreement {check['argmax_agreement']:.3f}")
    _log(f"done: held-out loss {summary['heldout_loss']:.4f} nats/token "
         f"({summary['heldout_bits_per_char']:.3f} bits/char), {summary['params'] / 1e6:.2f}M parameters")
    return 0


def _write_prompts(path: str, prompts: list[str]) -> None:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


def cmd_draft(args) -> int:
    import dflash_jax as dj
    from dflash_jax.demo import corpus
    from train.config import TrainConfig
    from train.export import ExportError, check_export_dir, export
    from train.loop import train
    from train.make_data import make_data

    out = _out_dir(args, "draft")
    if out is None:
        return 2
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        _log(f"no target at {args.target}: run `python -m train.demo_recipe target` first")
        return 2
    if args.init_draft and not os.path.isfile(os.path.join(args.init_draft, "config.json")):
        _log(f"--init-draft {args.init_draft}: no draft there (expected an exported draft directory with "
             "config.json + model.safetensors)")
        return 2
    work = os.path.join(args.work, "draft")
    prompts, evals = os.path.join(work, "prompts.jsonl"), os.path.join(work, "eval_prompts.jsonl")
    data = os.path.join(work, "data")
    cfg = TrainConfig(target=args.target, data=data, out=os.path.join(work, "run"), draft_layers=args.draft_layers,
                      block_size=args.block_size, num_target_features=args.features, num_anchors=args.anchors,
                      seq_len=args.seq_len, lr=args.lr, batch_size=args.batch_size, steps=args.steps,
                      seed=args.seed, dtype="float32", cache_features=True, save_every=100, log_every=10,
                      init_draft=args.init_draft or "",
                      eval_every=args.eval_every, eval_prompts=evals, eval_max_new_tokens=96,
                      progress=not args.no_progress)
    if not args.replace_shipped:  # before the data and the training, not after
        try:
            check_export_dir(out, cfg.to_json())
        except ExportError as e:
            _log(str(e))
            return 2
    os.makedirs(work, exist_ok=True)
    lo, hi = args.prompt_chars
    _write_prompts(prompts, corpus.code_prompts(corpus.train_files(), args.num_prompts, seed=args.seed,
                                                min_chars=lo, max_chars=hi))
    _write_prompts(evals, corpus.code_prompts(corpus.heldout_files(), 8, seed=args.seed + 1,
                                              min_chars=120, max_chars=400))
    target = dj.load_target(args.target)
    t = time.time()
    make_data(target, prompts, data, max_new_tokens=args.response_tokens, batch_size=args.gen_batch_size,
              log=_log)
    _log(f"data: the target answered {args.num_prompts} prompts ({args.response_tokens} tokens max) in "
         f"{time.time() - t:.0f}s -> {data}")
    train(cfg, log=_log)
    export(cfg.out, out, dtype="bfloat16", force=args.replace_shipped)
    _log(f"exported the draft to {out}: " + ", ".join(
        f"{n} {os.path.getsize(os.path.join(out, n)) / 1e6:.2f} MB" for n in sorted(os.listdir(out))))
    return 0


def _char_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX, got {lo},{hi}")
    return lo, hi


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default said once: not appended where its help already says it, nor for None (nothing set) or
    a flag's False."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.demo_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    t = sub.add_parser("target", help="tokenizer + pretraining of the demo target (resumable)",
                       description="Train the demo target end to end (rerun to resume).", formatter_class=_Defaults)
    t.add_argument("--minutes", type=float, default=None,
                   help="training-loop wall-clock budget, summed over restarts (default 45 unless --steps); "
                        "the step count and cosine schedule are planned to end with it")
    t.add_argument("--steps", type=int, default=None, help="train exactly this many steps (with --minutes: "
                                                          "whichever comes first)")
    t.add_argument("--out", default=None, help="where the Hugging Face model directory goes (default: "
                                               "WORK/target/export)")
    t.add_argument("--replace-shipped", action="store_true",
                   help="allow --out to name the demo target the package ships (overwrites it)")
    t.add_argument("--work", default=DEFAULT_WORK, help="work files go to WORK/target (delete it to start over)")
    t.add_argument("--vocab-size", type=int, default=4096, help="byte-level BPE vocabulary (special tokens included)")
    t.add_argument("--layers", type=int, default=6, help="decoder layers")
    t.add_argument("--hidden", type=int, default=192, help="hidden size")
    t.add_argument("--heads", type=int, default=4, help="query heads")
    t.add_argument("--kv-heads", type=int, default=2, help="key / value heads (grouped-query attention)")
    t.add_argument("--head-dim", type=int, default=48, help="dimension of each head")
    t.add_argument("--intermediate", type=int, default=576, help="MLP width")
    t.add_argument("--seq-len", type=int, default=512, help="tokens per training window")
    t.add_argument("--batch-size", type=int, default=4, help="windows per step")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warmup + cosine to 10%%)")
    t.add_argument("--warmup-steps", type=int, default=50, help="steps of linear learning-rate warmup")
    t.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    t.add_argument("--eval-windows", type=int, default=16,
                   help="held-out windows (evenly spread) of the periodic evaluation; the final one uses all")
    t.add_argument("--save-minutes", type=float, default=3.0, help="minutes between checkpoints")
    t.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the window order")
    t.add_argument("--no-check", action="store_true", help="skip the transformers/PyTorch reload check")
    t.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    t.set_defaults(func=cmd_target)

    d = sub.add_parser("draft", help="data from the demo target + DFlash draft training + export (resumable)",
                       description="Train the demo draft end to end (rerun to resume). The defaults are the first "
                                   "run of the embedded draft (docs/training.md).", formatter_class=_Defaults)
    d.add_argument("--target", default=DEMO_TARGET, help="the demo target (Hugging Face directory)")
    d.add_argument("--out", default=None, help="where the exported draft goes (default: WORK/draft/export)")
    d.add_argument("--replace-shipped", action="store_true",
                   help="allow --out to name the demo draft the package ships (overwrites it)")
    d.add_argument("--work", default=DEFAULT_WORK, help="work files go to WORK/draft (delete it to start over)")
    d.add_argument("--num-prompts", type=int, default=2000, help="training prompts cut from the training modules")
    d.add_argument("--prompt-chars", type=_char_range, default=(120, 400), metavar="MIN,MAX",
                   help="prompt length range in characters (default 120,400; the benchmark's default prompts "
                        "are 200,600)")
    d.add_argument("--response-tokens", type=int, default=128, help="tokens the target generates per prompt")
    d.add_argument("--gen-batch-size", type=int, default=32, help="prompts per batch of data generation")
    d.add_argument("--draft-layers", type=int, default=2, help="draft decoder layers")
    d.add_argument("--features", type=int, default=3, help="number of target layers fused (ids over 1..L-1)")
    d.add_argument("--block-size", type=int, default=16, help="draft block (tokens per block, anchor included)")
    d.add_argument("--anchors", type=int, default=48, help="anchors per sequence")
    d.add_argument("--seq-len", type=int, default=256, help="tokens per training row (python -m train --seq-len)")
    d.add_argument("--batch-size", type=int, default=8, help="rows per step")
    d.add_argument("--steps", type=int, default=650, help="optimizer steps")
    d.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warmup + cosine)")
    d.add_argument("--eval-every", type=int, default=200,
                   help="steps between measurements of the real acceptance length on 8 held-out prompts")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts drawn (the held-out ones: seed + 1), the draft's init and the data order")
    d.add_argument("--init-draft", default=None,
                   help="continue from an exported draft directory (e.g. the embedded one) with a fresh schedule")
    d.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    d.set_defaults(func=cmd_draft)
    return p


def main(argv=None) -> int:
    launch()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
