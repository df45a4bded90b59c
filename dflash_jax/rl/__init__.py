"""Reinforcement-learning rollouts on the speculative engine: ``SpeculativeRollout`` (Tunix's ``BaseRollout``
interface, ``rollout``) and Tunix's Qwen3 NNX parameters <-> the project's target parameters (``tunix_params``)."""
from dflash_jax.rl.rollout import TUNIX, BaseRollout, RolloutConfig, RolloutOutput, SpeculativeRollout, seed_int
from dflash_jax.rl.tunix_params import from_tunix_qwen3, to_tunix_qwen3

__all__ = ["TUNIX", "BaseRollout", "RolloutConfig", "RolloutOutput", "SpeculativeRollout", "from_tunix_qwen3",
           "seed_int", "to_tunix_qwen3"]
