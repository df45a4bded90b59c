"""Command-line inference: ``python -m infer.generate``, ``infer.benchmark``, ``infer.serve``, ...; importing it does
nothing (each CLI's ``main()`` starts with ``dflash_jax.launch.launch``)."""
