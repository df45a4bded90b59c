"""The trainer's errors, and its warnings attributed to the caller of ``train`` (not to the module that warns)."""
from __future__ import annotations

import inspect
import os
import warnings

# the modules of one ``train`` call, whose warnings name the caller of ``train``
LOOP_MODULES = ("loop.py", "draft_setup.py", "step.py", "evaluate.py", "resume.py", "errors.py")


class TrainingDiverged(RuntimeError):
    """The run itself failed (a non-finite loss): not bad input; ``python -m train`` exits 1."""


class TrainingError(RuntimeError):
    """The run cannot start or resume as asked (inconsistent resume, unreadable checkpoints, ...); the message
    says what to do."""


def warn(msg: str) -> None:
    """``warnings.warn`` attributed to the first caller outside the training loop's modules (``train``'s caller)."""
    frame, level = inspect.currentframe().f_back, 2  # level 1 is this function
    while frame is not None and os.path.basename(frame.f_code.co_filename) in LOOP_MODULES \
            and os.path.dirname(frame.f_code.co_filename) == os.path.dirname(__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(msg, stacklevel=level)
