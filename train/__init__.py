"""Training DFlash drafts: data (make_data), objective, features, loop (``python -m train``), export; importing it
does nothing (each CLI's ``main()`` starts with ``dflash_jax.launch.launch``)."""
