"""Training DFlash drafts: data (make_data), objective, features, loop (``python -m train``), export."""
