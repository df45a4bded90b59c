"""dflash_jax: DFlash speculative decoding (block-diffusion draft) in JAX/Flax."""
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.target import Target, load_target, target_logits

__all__ = ["DraftConfig", "TargetConfig", "Target", "load_target", "target_logits"]
__version__ = "0.1.0"
