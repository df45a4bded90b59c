"""Training checkpoints with orbax: ``<out>/checkpoints/<step>/{params, opt_state, meta}``.

``params`` and ``opt_state`` are the float32 master pytrees; ``meta`` (JSON) holds the step, the
data position (epoch, step in epoch), the seed the anchors and the data order derive from, the
training config and the draft's Hugging Face config, so a run resumes exactly and a checkpoint
exports without the command line that made it.

A checkpoint that cannot be read (a truncated or deleted file, a corrupt ``meta``) raises a
``CheckpointError`` naming its step directory, never orbax's / tensorstore's own exception.
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import traceback

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
META_KEYS = ("step", "config", "draft_config")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (corrupt, truncated, incomplete); the message names its directory."""


def _reason(e: BaseException) -> str:
    """One short line about ``e``: the innermost exception of its chain that has a message (orbax wraps
    tensorstore's "OUT_OF_RANGE: Error reading ... in local file ..." in a many-line generic one)."""
    chain = [e]
    while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for x in reversed(chain):
        lines = str(x).strip().splitlines()
        line = lines[0].split(" See full TensorStore details")[0] if lines else ""
        if line:
            return f"{type(x).__name__}: {line[:300]}"
    return type(e).__name__


def _abstract(tree):
    """What to restore onto: each leaf's shape, dtype and sharding, this process's first device where a leaf has
    none (so a checkpoint written on other devices, e.g. by several processes, restores on one)."""
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def one(x):
        s = ocp.utils.to_shape_dtype_struct(x)
        return s if s.sharding is not None else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=local)

    return jax.tree_util.tree_map(one, tree)


_ORBAX_READ_ERROR = "Encountered error while reading array index"
_quieted = False


_TENSORSTORE_READ_ERROR = 'Error reading "'  # e.g. OUT_OF_RANGE: Error reading "<array>/0.0" in OCDBT database at ...


def _is_failed_read(text: str) -> bool:
    """Whether ``text`` (a log message, an exception's text) is one of a failed restore's reads: orbax's wrapper,
    its read coroutines, or a bare tensorstore read error in a future that orbax abandoned (which one a truncated
    file gives depends on which read fails first)."""
    return any(s in text for s in (_ORBAX_READ_ERROR, "_read_array_index_and_device_put", "async_deserialize",
                                   _TENSORSTORE_READ_ERROR))


class _FailedReadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("never retrieved" in msg and _is_failed_read(msg + str(record.exc_info and record.exc_info[1])))


def _is_closed_loop_callback(exc_type, exc, tb) -> bool:
    """A tensorstore read finishing after orbax closed its event loop: RuntimeError raised in
    ``call_soon_threadsafe`` called straight from tensorstore's C++ thread (no Python caller frame)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    return (exc_type is RuntimeError and str(exc) == "Event loop is closed" and bool(frames)
            and frames[0].name == "call_soon_threadsafe")


def _quiet_abandoned_reads() -> None:
    """Silence what the reads of a failed restore leave behind, though the error is reported once, by us:
    reads still in flight when orbax closes its event loop print "Event loop is closed" tracebacks from
    tensorstore's threads (through ``sys.excepthook`` or ``sys.unraisablehook``); their coroutines / tasks,
    when collected (now, later or at exit), print "Exception ignored in: <coroutine ...>" and "Task exception
    was never retrieved". Installed before the first restore (process-wide, matching only these), since the
    reads outlive it."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def unraisable(u):
        if not (_is_failed_read(repr(u.object)) or _is_failed_read(str(u.exc_value))
                or _is_closed_loop_callback(u.exc_type, u.exc_value, u.exc_traceback)):
            previous_unraisable(u)

    def excepthook(exc_type, exc, tb):
        if not _is_closed_loop_callback(exc_type, exc, tb):
            previous_except(exc_type, exc, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
    logging.getLogger("asyncio").addFilter(_FailedReadFilter())


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, create: bool = True):
        self.directory = os.path.abspath(directory)
        self.options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
        self.manager = ocp.CheckpointManager(self.directory, options=self.options)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

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
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 -- JSON, missing file, orbax metadata errors: all "unreadable"
            raise CheckpointError(f"checkpoint {self.step_dir(step)} is unreadable: its meta cannot be read "
                                  f"({_reason(e)})") from None
        missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
        if missing:
            raise CheckpointError(f"checkpoint {self.step_dir(step)} is unreadable: its meta lacks {missing}")
        return meta

    def restore(self, step: int, params_like, opt_state_like=None):
        """-> (params, opt_state or None, meta); ``*_like`` give the structure (arrays or ShapeDtypeStructs)."""
        _quiet_abandoned_reads()
        items = {"params": ocp.args.StandardRestore(_abstract(params_like)), "meta": ocp.args.JsonRestore()}
        if opt_state_like is not None:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state_like))
        try:
            r = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 -- tensorstore errors of truncated / deleted files, bad metadata
            err = CheckpointError(f"checkpoint {self.step_dir(step)} is unreadable: corrupt or missing files "
                                  f"({_reason(e)})")
        else:
            return r.params, (r.opt_state if opt_state_like is not None else None), r.meta
        gc.collect()  # the failed reads' coroutines: collected now, quietly
        raise err

    def set_aside(self, step: int, where: str) -> str:
        """Move the directory of ``step`` into ``where`` (out of the manager's sight, kept for inspection);
        returns its new path. Call ``reload`` afterwards."""
        os.makedirs(where, exist_ok=True)
        dest, n = os.path.join(where, str(step)), 1
        while os.path.exists(dest):
            n += 1
            dest = os.path.join(where, f"{step}.{n}")
        shutil.move(self.step_dir(step), dest)
        return dest

    def reload(self) -> None:
        """Re-read the step directories (after ``set_aside``)."""
        self.close()
        self.manager = ocp.CheckpointManager(self.directory, options=self.options)

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
