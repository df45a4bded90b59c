"""The OpenAI-compatible server (``python -m infer.serve``): ``protocol`` (request bodies, errors), ``text``
(incremental detokenization, stop strings), ``metrics`` (Prometheus), ``scheduler`` (the engine thread and its
queue), ``service`` (models, engine, request checks), ``app`` (the FastAPI routes), ``__main__`` (the CLI)."""
