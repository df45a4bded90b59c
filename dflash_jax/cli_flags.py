"""Flags that mean the same in every command line (``infer.*``, ``train.*``), spelled and resolved once, and the
deprecated spellings they replaced, still accepted with a warning."""
from __future__ import annotations

import argparse
import sys

from dflash_jax.checkpoints import DTYPES, auto_dtype, resolve_path


def add_dtype_arg(group) -> None:
    """``--dtype``: the parameter / compute dtype of the loaded models; ``auto`` by ``resolve_dtype_arg``."""
    group.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                       help="parameter/compute dtype; auto (default): the checkpoint's dtype on TPU/GPU, float32 on "
                            "CPU (where bfloat16 is emulated and slower); the dtype that ran is printed")


def resolve_dtype_arg(dtype: str, target_path: str) -> str:
    """``--dtype`` as a dtype name: auto is the TARGET checkpoint's dtype (float32 on CPU), for the draft too, so
    that both compute in one dtype."""
    return auto_dtype(resolve_path(target_path)) if dtype == "auto" else dtype


class _Deprecated(argparse.Action):
    """An old spelling of an option: stores into the new option's dest after one warning line naming the new flag."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed(parser, new: str, old: str, *, required: bool = False, **kwargs) -> argparse.Action:
    """Add option ``new`` (``kwargs`` as ``add_argument``'s) with ``old`` as its deprecated spelling: hidden from
    --help, the same value, a warning on stderr; ``required``: one of the two spellings must be given."""
    if required:
        parser = parser.add_mutually_exclusive_group(required=True)
    action = parser.add_argument(new, **kwargs)
    parser.add_argument(old, dest=action.dest, type=action.type, choices=action.choices, metavar=action.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=_Deprecated, new=new)
    return action
