"""Drafts: the config of a draft model in every format it may come in (``config.DraftConfig``) and the format
registry (``formats.FORMATS``: what each format reads, writes, checks and changes). The draft model itself is
``dflash_jax.draft``."""
from dflash_jax.drafts.config import DraftConfig
from dflash_jax.drafts.formats import FORMATS, DraftFormat

__all__ = ["FORMATS", "DraftConfig", "DraftFormat"]
