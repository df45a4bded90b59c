"""examples/grpo.py: its loop on a tiny random pair (two updates, the draft adapted online) produces its records,
and after each ``engine.update_params`` the engine's greedy output equals plain decoding of the new weights."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from dflash_jax.target import Target
from tests.pairs import random_pair

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_loop_runs_and_rollouts_follow_the_updated_policy():
    grpo = _example()
    target, draft = random_pair(vocab=64, block_size=8, seed=0, draft_layers=1, target_layer_ids=(0, 1), layers=2,
                                eos_token_id=(62,))
    target = Target(target.config, dict(target.params, lm_head={"kernel": target.params["lm_head"]["kernel"] * 3}))
    prompts = [[5, 9, 14, 3], [40, 41, 7, 22, 30]]
    seen = []
    records = grpo.loop(target, draft, prompts, grpo.token_set_reward(set(range(10, 20))), updates=2, group=2,
                        max_new_tokens=12, lr=1e-3, adapt_draft=True, draft_lr=1e-3, draft_steps=1, check=True,
                        on_record=seen.append)
    assert records == seen and [r["update"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["reward"] <= 1.0 and r["tau"] >= 1.0 and r["tokens"] > 0
        assert r["draft_s"] > 0 and np.isfinite(r["loss"]) and np.isfinite(r["draft_loss"])
        assert r["greedy_equal"] is True
        assert r["logprob_err"] < 1e-4  # the engine's logprobs: the target's own


def test_the_cli_parses_and_group_advantages_are_normalised():
    grpo = _example()
    args = grpo.build_parser().parse_args(["--updates", "3", "--adapt-draft", "--json"])
    assert args.updates == 3 and args.adapt_draft and args.json and not args.plain
    for a in grpo.build_parser()._actions:
        assert a.help, a.dest
    adv = grpo.group_advantages(np.array([0.0, 1.0, 0.5, 0.5]), 2)
    assert np.allclose(adv, [-1, 1, 0, 0], atol=1e-3)
