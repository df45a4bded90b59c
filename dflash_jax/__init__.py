"""dflash_jax: DFlash speculative decoding (block-diffusion draft) in JAX/Flax."""
from dflash_jax.config import TargetConfig
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.model import Draft, draft_block_logits, draft_block_tokens, load_draft, save_draft
from dflash_jax.decode import GenerationResult, generate, speculative_generate, stream_generate
from dflash_jax.scoring import per_token_logps
from dflash_jax.target import Target, load_target, target_logits

__all__ = ["DraftConfig", "TargetConfig", "Target", "Draft", "GenerationResult", "load_target", "load_draft",
           "save_draft", "target_logits", "per_token_logps", "draft_block_logits", "draft_block_tokens",
           "speculative_generate", "generate", "stream_generate"]
__version__ = "0.1.0"
