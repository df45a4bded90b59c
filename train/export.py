"""``python -m train.export --checkpoint C --out DIR``: a training checkpoint -> the released draft layout.

C is a training ``--out`` directory (latest checkpoint), its ``checkpoints/`` directory, or one
``checkpoints/<step>`` directory. DIR gets ``config.json`` + ``model.safetensors`` (no ``model.``
prefix, PyTorch [out, in] weights) via ``dflash_jax.draft.save_draft``: loadable by
``dflash_jax.draft.load_draft`` and by the original PyTorch implementation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from dflash_jax.checkpoints import DTYPES
from dflash_jax.config import DraftConfig
from dflash_jax.draft import Draft, draft_param_shapes, save_draft
from train.checkpoint import Checkpointer, find_checkpoint


def load_checkpoint_draft(checkpoint: str) -> tuple[Draft, dict]:
    """(Draft with the checkpoint's float32 master params, checkpoint meta)."""
    directory, step = find_checkpoint(checkpoint)
    ckpt = Checkpointer(directory, create=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    meta = ckpt.meta(step)
    dcfg = DraftConfig.from_hf(meta["draft_config"])
    like = draft_param_shapes(dcfg)
    params, _, meta = ckpt.restore(step, like)
    ckpt.close()
    return Draft(dcfg, params, os.path.join(directory, str(step))), meta


def export(checkpoint: str, out: str, dtype: str = "bfloat16") -> str:
    draft, meta = load_checkpoint_draft(checkpoint)
    save_draft(draft, out, dtype=dtype)
    with open(os.path.join(out, "training_info.json"), "w") as f:
        json.dump({"step": meta["step"], "train_config": meta["config"], "metrics": meta.get("metrics")}, f, indent=2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="training out dir, its checkpoints/ dir, or checkpoints/<step>")
    p.add_argument("--out", required=True, help="directory for config.json + model.safetensors")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of the exported weights (the released drafts are bfloat16)")
    a = p.parse_args(argv)
    try:
        out = export(a.checkpoint, a.out, a.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported draft to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
