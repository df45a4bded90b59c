"""``python -m train.export --checkpoint C --out DIR``: a training checkpoint -> the released draft layout.

C is a training ``--out`` directory (latest checkpoint), its ``checkpoints/`` directory, or one
``checkpoints/<step>`` directory. DIR gets ``config.json`` + ``model.safetensors`` (no ``model.``
prefix, PyTorch [out, in] weights) via ``dflash_jax.drafts.model.save_draft``: loadable by
``dflash_jax.drafts.model.load_draft`` and by the original PyTorch implementation.

DIR may be new, empty, or a previous export of the same training run (training_info.json naming the same
--out and run-defining settings; typically an earlier checkpoint): its config.json, model.safetensors and
training_info.json are overwritten, other files kept. Anything else -- another draft's export, another model's
config.json, other weight files -- is refused unless ``--force``: the export would replace a draft that other
files there may belong to, or destroy a target pointed at by mistake.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from dflash_jax.checkpoints import DTYPES
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.formats import architecture_formats
from dflash_jax.drafts.model import Draft, draft_param_shapes, save_draft
from dflash_jax.launch import launch
from train.orbax_checkpoints import Checkpointer, CheckpointError, find_checkpoint

# the architectures this trainer exports (config.json "architectures"): the trainable formats' (DFlash, DSpark)
DRAFT_ARCHITECTURES = tuple([a] for a, f in architecture_formats().items() if f.trainable)
EXPORT_FILES = ("config.json", "model.safetensors", "training_info.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".npy",
                   ".index.json")


class ExportError(ValueError):
    """--out holds something an export must not overwrite."""


def check_export_dir(out: str, train_config: dict) -> None:
    """Raise ``ExportError`` unless ``out`` is absent, empty, or a previous export of the run ``train_config``
    describes (see the module doc)."""
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ExportError(f"--out {out} exists and is not a directory")
    names = os.listdir(out)
    cfg_path = os.path.join(out, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                arch = json.load(f).get("architectures")
        except (OSError, ValueError, AttributeError):
            arch = "unreadable"
        if arch not in DRAFT_ARCHITECTURES:
            raise ExportError(f"--out {out} holds another model (config.json architectures {arch}, not a DFlash "
                              "draft); exporting would overwrite it: choose another --out, or pass --force")
        if not same_run(os.path.join(out, "training_info.json"), train_config):
            raise ExportError(f"--out {out} holds the export of another draft (not of the training run "
                              f"{train_config.get('out')}); choose another --out, or pass --force to replace it")
    weights = sorted(n for n in names if n.endswith(WEIGHT_SUFFIXES) and n not in EXPORT_FILES)
    if "model.safetensors" in names and not os.path.isfile(cfg_path):
        weights.insert(0, "model.safetensors")
    if weights:
        raise ExportError(f"--out {out} holds other weight files ({', '.join(weights[:3])}"
                          f"{', ...' if len(weights) > 3 else ''}), not a previous draft export; choose another "
                          "--out, or pass --force")


def same_run(info_path: str, train_config: dict) -> bool:
    """Whether the export's ``training_info.json`` comes from the run ``train_config`` describes: the same --out
    and the settings a resumed run must keep (``train.resume.RESUME_FIXED``)."""
    from train.resume import RESUME_FIXED

    try:
        with open(info_path) as f:
            old = json.load(f)["train_config"]
        return all(old.get(k) == train_config.get(k) for k in ("out", *RESUME_FIXED))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or unreadable: not ours
        return False


def load_checkpoint_draft(checkpoint: str, check_meta=None) -> tuple[Draft, dict]:
    """(Draft with the checkpoint's float32 master params, checkpoint meta); ``check_meta(meta)`` runs on the meta
    alone, before the parameters are read (a refusal costs no restore)."""
    directory, step = find_checkpoint(checkpoint)
    ckpt = Checkpointer(directory, create=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    try:
        meta = ckpt.meta(step)
        if check_meta is not None:
            check_meta(meta)
        dcfg = DraftConfig.from_hf(meta["draft_config"])
        params, _, meta = ckpt.restore(step, draft_param_shapes(dcfg))
    finally:
        ckpt.close()
    return Draft(dcfg, params, os.path.join(directory, str(step))), meta


def export(checkpoint: str, out: str, dtype: str = "bfloat16", force: bool = False) -> str:
    """Write the draft of ``checkpoint`` to ``out``; refuses (``ExportError``) an ``out`` holding another model or
    another run's draft unless ``force``."""
    check = None if force else (lambda meta: check_export_dir(out, meta["config"]))
    draft, meta = load_checkpoint_draft(checkpoint, check)
    save_draft(draft, out, dtype=dtype)
    with open(os.path.join(out, "training_info.json"), "w") as f:
        json.dump({"step": meta["step"], "train_config": meta["config"], "metrics": meta.get("metrics")}, f, indent=2)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="training out dir, its checkpoints/ dir, or checkpoints/<step>")
    p.add_argument("--out", required=True, help="directory for config.json + model.safetensors")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of the exported weights (the released drafts are bfloat16)")
    p.add_argument("--force", action="store_true", help="export even into a directory that holds another model or "
                   "another run's draft (its config.json / model.safetensors are overwritten, other files kept)")
    return p


def main(argv=None) -> int:
    launch()
    a = build_parser().parse_args(argv)
    try:
        out = export(a.checkpoint, a.out, a.dtype, force=a.force)
    except (OSError, ValueError, CheckpointError) as e:  # bad input: exit 2, as argparse and the infer CLIs
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported draft to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
