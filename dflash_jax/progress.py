"""The one progress bar of the project (weight loading, training, data and feature generation)."""
from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(total: int | None, desc: str, unit: str, enabled: bool = True, initial: int = 0, **kw) -> tqdm:
    """A tqdm bar on stderr; when not ``enabled`` a disabled one (every method a no-op), so callers never
    branch. ``kw`` goes to tqdm (e.g. ``mininterval``)."""
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True, **kw)
