"""Offline target features (``--cache-features``): computed once, stored on disk, memory-mapped back.

Layout of a feature directory::

    manifest.json     {"format": "dflash-jax-features", "layer_ids": [...], "width": n*D,
                       "dtype": "bfloat16", "seq_len": S, "num_sequences": n, "fingerprint": "...",
                       "shards": [{"file": "feat_00000.npy", "first": 0, "count": c, "tokens": t}, ...]}
    feat_00000.npy    [t, n*D] features of sequences first..first+c-1 of the training data, concatenated
                      (bfloat16 is stored as its uint16 bit pattern; the manifest says which)

Features are those of the truncated training sequences in ``TrainData`` order, computed by the same
frozen target forward as the online path (batches padded to seq_len; the target is causal, so the
padding never changes a real position's features). A packed row's features are its sequences'
features one after the other: what the online path computes within each document. The fingerprint
(token ids, seq_len, layer ids, target) guards against training from features of other data or
another target. Writing is resumable: finished shards are kept, the manifest is updated after each one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints import DTYPES
from train.data import MANIFEST, DataError, TrainData, load_manifest, write_manifest
from dflash_jax.progress import progress_bar

FORMAT = "dflash-jax-features"
_NP = {name: np.dtype(t) for name, t in DTYPES.items()}
# .npy has no bfloat16: stored as its uint16 bit pattern (the manifest's "dtype" says how to view it)
_STORE = {**_NP, "bfloat16": np.dtype(np.uint16)}


def fingerprint(data: TrainData, layer_ids, target_path: str | None, target_dtype: str) -> str:
    h = hashlib.sha1()
    h.update(json.dumps([list(map(int, layer_ids)), data.seq_len, len(data), os.path.abspath(target_path or ""),
                         target_dtype]).encode())
    for x in data.ids:
        h.update(np.int64(len(x)).tobytes())
        h.update(np.ascontiguousarray(x, np.int32).tobytes())
    return h.hexdigest()


class FeatureStore:
    """Read side: memory-mapped shards; ``batch(indices)`` -> rows (as ``TrainData.batch``) [..., seq_len, width]."""

    def __init__(self, directory: str, data: TrainData, manifest: dict):
        self.directory, self.data, self.manifest = directory, data, manifest
        self.width = int(manifest["width"])
        self.dtype = manifest["dtype"]
        self._where = np.zeros((len(data), 2), np.int64)  # (shard, start row) of each sequence
        self._shards = []
        for si, sh in enumerate(manifest["shards"]):
            arr = np.load(os.path.join(directory, sh["file"]), mmap_mode="r")
            lens = [len(data.ids[i]) for i in range(sh["first"], sh["first"] + sh["count"])]
            if arr.shape != (sum(lens), self.width):
                raise DataError(f"feature shard {sh['file']} has shape {arr.shape}, expected "
                                f"{(sum(lens), self.width)}; delete {directory} to recompute")
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
            self._where[sh["first"]:sh["first"] + sh["count"], 0] = si
            self._where[sh["first"]:sh["first"] + sh["count"], 1] = starts
            self._shards.append(arr)

    def batch(self, indices: np.ndarray) -> np.ndarray:
        flat = np.asarray(indices).reshape(-1)
        out = np.zeros((len(flat), self.data.seq_len, self.width), _NP[self.dtype])
        for r, i in enumerate(flat):
            at = 0
            for j in self.data.row(i):
                si, start = self._where[j]
                n = len(self.data.ids[j])
                out[r, at:at + n] = self._shards[si][start:start + n].view(_NP[self.dtype])
                at += n
        return out.reshape(tuple(np.shape(indices)) + out.shape[1:])

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self._shards))


@functools.lru_cache(maxsize=8)
def _features_fn(tcfg, layer_ids):
    from train.objective import target_features

    return jax.jit(lambda p, ids: target_features(tcfg, p, ids, layer_ids))


def build_feature_store(target, layer_ids, data: TrainData, directory: str, *, batch_size: int = 1,
                        dtype: str = "bfloat16", sequences_per_shard: int = 256, progress: bool = True,
                        log=print) -> FeatureStore:
    """Compute (or finish computing) the features of every training sequence; return the store."""
    if dtype not in _NP:
        raise ValueError(f"feature dtype must be one of {sorted(_NP)}, got {dtype!r}")
    os.makedirs(directory, exist_ok=True)
    layer_ids = tuple(int(i) for i in layer_ids)
    target_dtype = str(jax.tree_util.tree_leaves(target.params)[0].dtype)
    fp = fingerprint(data, layer_ids, target.path, target_dtype)
    width = len(layer_ids) * target.config.hidden_size
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        manifest = load_manifest(directory, FORMAT, f"; delete {directory} to recompute")
        same = (manifest.get("fingerprint") == fp and manifest.get("dtype") == dtype
                and manifest.get("width") == width and manifest.get("layer_ids") == list(layer_ids))
        if not same:
            raise DataError(f"the features in {directory} were computed for other data, target, layer ids or "
                            "dtype; delete the directory (or pass another --feature-dir) to recompute")
    else:
        manifest = {"format": FORMAT, "version": 1, "layer_ids": list(layer_ids), "width": width, "dtype": dtype,
                    "seq_len": data.seq_len, "num_sequences": len(data), "fingerprint": fp,
                    "target": target.path, "target_dtype": target_dtype,
                    "sequences_per_shard": sequences_per_shard, "shards": []}
    per = int(manifest.get("sequences_per_shard", sequences_per_shard))
    done = {sh["first"] for sh in manifest["shards"]}
    todo = [first for first in range(0, len(data), per) if first not in done]
    if todo:
        fn = _features_fn(target.config, layer_ids)
        tokens_todo = sum(len(data.ids[i]) for f in todo for i in range(f, min(f + per, len(data))))
        bar = progress_bar(tokens_todo, "features", "tok", progress)
        for first in todo:
            idx = np.arange(first, min(first + per, len(data)))
            lens = [len(data.ids[i]) for i in idx]
            out = np.empty((sum(lens), width), _NP[dtype])
            row = 0
            for b0 in range(0, len(idx), batch_size):
                chunk = idx[b0:b0 + batch_size]
                padded = np.concatenate([chunk, np.full(batch_size - len(chunk), chunk[0])])  # one shape
                ids, _ = data.sequences(padded)
                feats = np.asarray(jax.device_get(fn(target.params, jnp.asarray(ids))).astype(_NP[dtype]))
                for r, i in enumerate(chunk):
                    n = len(data.ids[i])
                    out[row:row + n] = feats[r, :n]
                    row += n
                bar.update(sum(len(data.ids[i]) for i in chunk))
            name = f"feat_{first // per:05d}.npy"
            tmp = os.path.join(directory, name + ".tmp.npy")
            np.save(tmp, out.view(_STORE[dtype]))
            os.replace(tmp, os.path.join(directory, name))
            manifest["shards"].append({"file": name, "first": int(first), "count": len(idx), "tokens": int(sum(lens))})
            manifest["shards"].sort(key=lambda s: s["first"])
            write_manifest(directory, manifest)
        bar.close()
    elif log:
        log(f"features: reusing {directory}")
    write_manifest(directory, manifest)
    return FeatureStore(directory, data, manifest)

