"""Training checkpoints with orbax: ``<out>/checkpoints/<step>/{params, opt_state, meta}``.

``params`` and ``opt_state`` are the float32 master pytrees; ``meta`` (JSON) holds the step, the
data position (epoch, step in epoch), the seed the anchors and the data order derive from, the
training config and the draft's Hugging Face config, so a run resumes exactly and a checkpoint
exports without the command line that made it.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


def _abstract(tree):
    return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, create: bool = True):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, params_like, opt_state_like=None):
        """-> (params, opt_state or None, meta); ``*_like`` give the structure (arrays or ShapeDtypeStructs)."""
        items = {"params": ocp.args.StandardRestore(_abstract(params_like)), "meta": ocp.args.JsonRestore()}
        if opt_state_like is not None:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state_like))
        r = self.manager.restore(step, args=ocp.args.Composite(**items))
        return r.params, (r.opt_state if opt_state_like is not None else None), r.meta

    def close(self) -> None:
        self.wait()
        self.manager.close()


def find_checkpoint(path: str) -> tuple[str, int | None]:
    """A training out dir, its ``checkpoints/`` dir, or one step dir -> (checkpoints dir, step or None=latest)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
        return os.path.join(path, CHECKPOINT_DIR), None
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "params")):
        return os.path.dirname(path), int(base)
    if any(d.isdigit() for d in os.listdir(path)):
        return path, None
    raise FileNotFoundError(f"{path!r} holds no training checkpoint (expected <out>, <out>/{CHECKPOINT_DIR} "
                            f"or <out>/{CHECKPOINT_DIR}/<step>)")
