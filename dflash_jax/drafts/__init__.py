"""Drafts: the config of a draft model in every format it may come in (``config.DraftConfig``), the format registry
(``formats.FORMATS``: what each format reads, writes, checks and changes), the shared draft model (``model``) and
the layers a format adds (``dflash2``, ``dspark``)."""
from dflash_jax.drafts.config import DraftConfig
from dflash_jax.drafts.formats import FORMATS, DraftFormat

__all__ = ["FORMATS", "DraftConfig", "DraftFormat"]
