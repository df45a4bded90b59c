"""A training run's evaluation: the real acceptance length of greedy speculative decoding on held-out prompts."""
from __future__ import annotations


import jax
import numpy as np

from dflash_jax.drafts.model import Draft
from dflash_jax.prompts import encode_prompt, read_prompts
from dflash_jax.target import Target
from train import objective
from train.data import TrainData


def prompts_from_data(data: TrainData, n: int) -> list[list[int]]:
    """The prompt (everything before the first supervised token) of the first ``n`` training sequences."""
    out = []
    for ids, mask in zip(data.ids[:n], data.masks[:n]):
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        out.append(ids[:max(first, 1)].tolist())
    return out


def load_eval_prompts(path: str, tokenizer, n: int, chat: bool = False) -> list[list[int]]:
    """The first ``n`` prompts of a prompts file, encoded as ``infer.generate`` encodes them."""
    return [encode_prompt(r, tokenizer, chat) for r in read_prompts(path)[:n]]


def evaluate(target: Target, draft: Draft, prompts: list[list[int]], *, max_new_tokens: int,
             stop_token_ids=None) -> dict:
    """Real acceptance length: greedy speculative decoding of ``prompts``; tau = mean over all verify steps
    of (accepted drafts + 1), as in the paper."""
    from dflash_jax.decode import speculative_generate

    dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
    d = Draft(draft.config, objective.cast_tree(draft.params, dtype), draft.path)
    res = speculative_generate(target, d, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    acc = [a for r in res for a in r.acceptance_lengths]
    gen = sum(r.num_generated for r in res)
    wall = max(r.wall_time_s for r in res) if res else 0.0
    return {"tau": float(np.mean(acc)) if acc else 0.0,
            "tau_per_prompt": [round(r.mean_acceptance_length, 3) for r in res],
            "verify_steps": len(acc), "generated": gen,
            "tokens_per_second": gen / wall if wall > 0 else 0.0}
