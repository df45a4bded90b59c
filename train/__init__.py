"""Training DFlash drafts: data (make_data), objective, features, loop (``python -m train``), export."""
import infer  # noqa: F401  (its import exits in one line when dflash_jax is a shadowing folder: require_the_package)
