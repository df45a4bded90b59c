"""A small GRPO loop with speculative rollouts: the demo target (a small Qwen3 trained on Python source) learns to
write more newlines, sampling its rollouts through the DFlash engine, its draft frozen or trained online.

Each update: ``--prompts`` prompts x ``--group`` samples at temperature 1 through one ``decode.Engine`` (the
draft proposes, the target verifies: the samples are exactly the target's), the log-probabilities of the sampled
tokens (the engine's own, ``Request(logprobs=0)``: from the verify forwards, no extra forward), a reward per
sample (the share of its tokens holding a newline: a CPU computes it, and the policy moves towards it within ~20
updates), group-normalised advantages, ``--epochs`` steps of the clipped-ratio objective (no KL term) by
``jax.grad`` through ``scoring.next_token_logps``, then ``engine.update_params``: the next rollouts are exactly
the new policy's, nothing recompiles. ``--adapt-draft`` trains the draft between updates on the rollouts just
generated (``train.online.OnlineDraftTrainer``); ``--plain`` rolls out without a draft (the baseline).

    python examples/grpo.py --updates 20              # the draft frozen
    python examples/grpo.py --updates 20 --adapt-draft
    python examples/grpo.py --updates 20 --plain --json

One line per update: mean reward, tau (tokens per target forward), rollout tokens/s, the seconds of the rollouts,
the policy step and the draft training. The first update's rollout time includes compilation.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dflash_jax import decode  # noqa: E402
from dflash_jax.scoring import next_token_logps, padded, per_token_logps  # noqa: E402
from dflash_jax.target import Target  # noqa: E402
from train.objective import cast_tree  # noqa: E402
from train.optim import make_optimizer  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--updates", type=int, default=20, help="policy updates (each: rollouts, one GRPO step)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per update (cut from held-out stdlib modules)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens sampled per rollout")
    p.add_argument("--lr", type=float, default=1e-4, help="the policy's learning rate (AdamW, clipped at 1)")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps on each batch of rollouts (the ratio "
                                                         "moves off 1 after the first, where clipping acts)")
    p.add_argument("--clip-eps", type=float, default=0.2, help="the ratio's clip range, [1 - eps, 1 + eps]")
    p.add_argument("--adapt-draft", action="store_true", help="train the draft online between updates "
                                                                "(train.online.OnlineDraftTrainer); off: frozen")
    p.add_argument("--draft-lr", type=float, default=3e-4, help="the online draft training's learning rate")
    p.add_argument("--draft-steps", type=int, default=2, help="draft optimizer steps per update (--adapt-draft)")
    p.add_argument("--draft-anchors", type=int, default=16, help="blocks per rollout in each draft step")
    p.add_argument("--plain", action="store_true", help="roll out without a draft (the baseline)")
    p.add_argument("--check", action="store_true", help="after each update: the engine's greedy output equals plain "
                                                        "decoding of the new weights; engine logprobs equal "
                                                        "per_token_logps")
    p.add_argument("--json", action="store_true", help="print one JSON record per update instead of the table")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the samples")
    return p


# --- rewards --------------------------------------------------------------------------------------------


def token_set_reward(ids: set[int]) -> Callable[[Sequence[int]], float]:
    """The share of a completion's tokens that are in ``ids`` (0 for an empty completion)."""
    return lambda completion: float(np.mean([t in ids for t in completion])) if len(completion) else 0.0


def newline_tokens(tokenizer) -> set[int]:
    """The ids whose text holds a newline."""
    return {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over the group's standard deviation (+1e-4)."""
    r = np.asarray(rewards, np.float32).reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)


# --- the policy step ------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer"), donate_argnums=(1, 2))
def grpo_step(cfg, params, opt_state, ids, mask, old_logps, advantages, lr, eps, optimizer):
    """One AdamW step of the clipped surrogate -mean_t min(r_t A, clip(r_t, 1 - eps, 1 + eps) A), r_t = p / p_old
    of each completion token (``mask`` [R, L-1] on position t when token t + 1 is sampled), at temperature 1."""

    def loss_fn(p):
        logp = next_token_logps(cfg, p, ids, 1.0)[1]
        ratio = jnp.exp(logp - old_logps)
        a = advantages[:, None]
        obj = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps, 1 + eps) * a)
        return -jnp.sum(obj * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = jax.tree_util.tree_map(lambda x, u: (x - lr * u).astype(x.dtype), params, updates)
    return params, opt_state, loss


def policy_batch(cfg, prompts, completions, old_logps):
    """(ids [R, L], mask [R, L-1], old log-probabilities [R, L-1]) for ``grpo_step``."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    ids = padded(cfg, seqs)
    mask = np.zeros((len(seqs), ids.shape[1] - 1), np.float32)
    old = np.zeros_like(mask)
    for r, (p, c, lp) in enumerate(zip(prompts, completions, old_logps)):
        mask[r, len(p) - 1:len(p) - 1 + len(c)] = 1.0
        old[r, len(p) - 1:len(p) - 1 + len(c)] = lp
    return ids, mask, old


# --- the loop -------------------------------------------------------------------------------------------


def greedy_matches_plain(engine: decode.Engine, target: Target, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int) -> bool:
    """The engine's greedy outputs (temperature-0 requests, one per row: the rollouts' programs) equal plain
    decoding of ``target`` (``decode.generate``: no draft)."""
    requests = [decode.Request(list(prompts[i % len(prompts)]), temperature=0.0, max_new_tokens=max_new_tokens)
                for i in range(engine.rows)]
    got = dict(decode.stream_requests(engine, requests))
    want = decode.generate(target, [r.prompt_ids for r in requests], max_new_tokens=max_new_tokens,
                           stop_token_ids=engine.options.stop_token_ids)
    return all(got[i].output_ids == w.output_ids for i, w in enumerate(want))


def old_logprobs(policy: Target, results, check: bool = False) -> tuple[list[np.ndarray], float | None]:
    """The sampling policy's log-probabilities of each result's generated tokens (temperature 1), the engine's own;
    with ``check`` also the largest |engine - per_token_logps| (one scoring forward; None without ``check``)."""
    logps = [np.asarray(r.logprobs, np.float32) for r in results]
    nonempty = [i for i, r in enumerate(results) if r.generated_ids]
    if not check or not nonempty:
        return logps, None
    scored = per_token_logps(policy, [results[i].output_ids[:results[i].prompt_length] for i in nonempty],
                             [results[i].generated_ids for i in nonempty], 1.0)
    return logps, max(float(np.max(np.abs(logps[i] - s))) for i, s in zip(nonempty, scored))


def loop(target: Target, draft, prompts: Sequence[Sequence[int]], reward: Callable[[Sequence[int]], float], *,
         updates: int, group: int = 4, max_new_tokens: int = 48, lr: float = 1e-4, epochs: int = 2,
         clip_eps: float = 0.2, adapt_draft: bool = False, draft_lr: float = 3e-4, draft_steps: int = 2,
         draft_anchors: int = 16, plain: bool = False, check: bool = False, seed: int = 0,
         on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """GRPO on ``target`` for ``updates`` updates; returns one record per update (and calls ``on_record`` with
    it): ``reward`` (mean), ``tau`` (None when plain), ``rollout_s``, ``rollout_tokens_per_s``, ``policy_s``,
    ``draft_s`` (None unless adapting), ``loss``, and with ``check`` ``greedy_equal`` and ``logprob_err`` (the
    largest |engine - per_token_logps|)."""
    if plain and adapt_draft:
        raise ValueError("--plain rolls out without a draft: nothing to adapt")
    draft = None if plain else draft
    stop = tuple(target.config.eos_token_id)
    rows = len(prompts) * group
    engine = decode.Engine(target, draft, decode.DecodeOptions(max_new_tokens=max_new_tokens, temperature=1.0,
                                                               stop_token_ids=stop),
                           max_batch=rows, max_length=max(map(len, prompts)) + max_new_tokens + 1, sampled=True,
                           page=0)  # slots: every row is admitted at once, one run program (paging pays for ragged
    # traffic: rows of a server coming and going; a rollout batch starts together and ends by its longest row)
    trainer = None
    if adapt_draft:
        from train.online import OnlineDraftTrainer

        trainer = OnlineDraftTrainer(target, draft, learning_rate=draft_lr, steps_per_update=draft_steps,
                                     num_anchors=draft_anchors, seed=seed)
    engine_dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
    params = cast_tree(target.params, jnp.float32)  # the policy's master weights
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
    optimizer = make_optimizer(1.0, 0.9, 0.99, 0.0)
    opt_state = optimizer.init(params)
    records = []
    for u in range(updates):
        requests = [r for i, p in enumerate(prompts)
                    for r in decode.Request(list(p), seed=seed * 100_003 + u, stream=i, logprobs=0).group(group)]
        t0 = time.perf_counter()
        results = dict(decode.stream_requests(engine, requests))
        rollout_s = time.perf_counter() - t0
        res = [results[i] for i in range(len(requests))]
        roll_prompts = [r.output_ids[:r.prompt_length] for r in res]
        completions = [r.generated_ids for r in res]
        rewards = np.asarray([reward(c) for c in completions], np.float32)
        logps, logprob_err = old_logprobs(engine.target, res, check)

        t1 = time.perf_counter()
        ids, mask, old = policy_batch(target.config, roll_prompts, completions, logps)
        adv = jnp.asarray(group_advantages(rewards, group))
        for _ in range(epochs):
            params, opt_state, loss = grpo_step(target.config, params, opt_state, jnp.asarray(ids), jnp.asarray(mask),
                                                jnp.asarray(old), adv, jnp.float32(lr), jnp.float32(clip_eps),
                                                optimizer)
        # copies in the engine's dtype: the next step donates the master weights
        new_target = Target(target.config, jax.tree_util.tree_map(lambda x: jnp.array(x, engine_dtype, copy=True),
                                                                  params), target.path)
        jax.block_until_ready(new_target.params)
        policy_s = time.perf_counter() - t1

        draft_s, draft_loss = None, None
        if trainer is not None:
            m = trainer.update([r.output_ids for r in res], [r.prompt_length for r in res], target=new_target)
            draft_s, draft_loss = m["seconds"], m["loss"]
            engine.update_params(new_target.params, trainer.draft.params)
        else:
            engine.update_params(new_target.params)
        generated = sum(len(c) for c in completions)
        acc = [a for r in res for a in r.acceptance_lengths]
        rec = {"update": u + 1, "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
               "tau": None if plain else float(np.mean(acc)) if acc else 0.0, "tokens": generated,
               "rollout_s": rollout_s, "rollout_tokens_per_s": generated / rollout_s if rollout_s > 0 else None,
               "policy_s": policy_s, "draft_s": draft_s, "draft_loss": draft_loss, "loss": float(loss)}
        if check:
            rec["greedy_equal"] = greedy_matches_plain(engine, new_target, prompts, max_new_tokens)
            rec["logprob_err"] = logprob_err
        records.append(rec)
        if on_record is not None:
            on_record(rec)
    return records


# --- the command line -----------------------------------------------------------------------------------


def demo_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` short code prompts from the held-out stdlib modules (the demo's own evaluation split), encoded."""
    from dflash_jax.demo.corpus import code_prompts, heldout_files

    return [tokenizer.encode(t) for t in code_prompts(heldout_files(), n, seed=seed, min_chars=120, max_chars=240)]


def table_line(rec: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    return (f"{rec['update']:>6}  {rec['reward']:.3f}  {f(rec['tau'], '5.2f'):>5}  "
            f"{f(rec['rollout_tokens_per_s'], '8.1f'):>8}  {rec['rollout_s']:8.2f}  {rec['policy_s']:7.2f}  "
            f"{f(rec['draft_s'], '6.2f'):>6}" + (f"  {rec['greedy_equal']}" if "greedy_equal" in rec else ""))


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    from dflash_jax.checkpoints import load_tokenizer
    from dflash_jax.demo import DEMO_DRAFT, DEMO_TARGET
    from dflash_jax.drafts.model import load_draft
    from dflash_jax.target import load_target

    target = load_target(DEMO_TARGET, dtype="float32")
    draft = None if args.plain else load_draft(DEMO_DRAFT, dtype="float32")
    tokenizer = load_tokenizer(DEMO_TARGET)
    prompts = demo_prompts(tokenizer, args.prompts, args.seed)
    reward = token_set_reward(newline_tokens(tokenizer))
    mode = "plain" if args.plain else "draft adapted online" if args.adapt_draft else "draft frozen"
    if not args.json:
        print(f"GRPO on the demo target ({mode}): {args.prompts} prompts x {args.group} "
              f"samples of {args.max_new_tokens} tokens, reward = share of newline tokens")
        print("update  reward    tau  tok/s      rollout_s  policy_s  draft_s" + ("  greedy=" if args.check else ""))
    show = (lambda r: print(json.dumps(r), flush=True)) if args.json else (lambda r: print(table_line(r), flush=True))
    records = loop(target, draft, prompts, reward, updates=args.updates, group=args.group,
                   max_new_tokens=args.max_new_tokens, lr=args.lr, epochs=args.epochs, clip_eps=args.clip_eps,
                   adapt_draft=args.adapt_draft, draft_lr=args.draft_lr, draft_steps=args.draft_steps,
                   draft_anchors=args.draft_anchors,
                   plain=args.plain, check=args.check, seed=args.seed, on_record=show)
    if not args.json and len(records) > 1:
        rest = records[1:]  # the first update compiles
        taus = [r["tau"] for r in rest if r["tau"] is not None]
        print(f"reward {records[0]['reward']:.3f} -> {records[-1]['reward']:.3f}; after the first update: "
              f"rollouts {np.mean([r['rollout_tokens_per_s'] for r in rest]):.1f} tokens/s"
              + (f", tau {np.mean(taus):.2f} (last {taus[-1]:.2f})" if taus else "")
              + (f", draft training {sum(r['draft_s'] for r in rest) / sum(r['rollout_s'] for r in rest):.0%} of "
                 "the rollout time" if args.adapt_draft else ""))
    return records


if __name__ == "__main__":
    main()
