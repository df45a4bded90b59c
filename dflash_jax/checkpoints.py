"""Hugging Face safetensors <-> Flax parameter trees, through one declarative name table per model.

A ``NameTable`` maps a Flax path to a tensor name: ``layers_N`` <-> ``layers.N``, leaves per ``_LEAVES``
(a Linear ``kernel`` is the transposed ``weight``), a family-specific prefix (``model.`` for the
targets, none for the drafts) except on names the table leaves unprefixed (``lm_head``). Shards are
memory-mapped and converted tensor by tensor, so a checkpoint is never held twice in memory; ``place``
decides where each tensor goes (one device, or its shards).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import sys
import warnings
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util
from safetensors import safe_open

from dflash_jax.progress import progress_bar

# flax leaf name -> (Hugging Face leaf name, stored transposed)
_LEAVES = {"kernel": ("weight", True), "embedding": ("weight", False), "weight": ("weight", False),
           "bias": ("bias", False)}

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              "F8_E4M3": ml_dtypes.float8_e4m3fn}  # FP8 weights: dequantised by a family's rewrite (dflash_jax.fp8)
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_PROGRESS_BYTES = 1 << 30  # checkpoints larger than this show a progress bar while loading
# The supported parameter / compute / storage dtypes by name: every --dtype flag's choices.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class NameTable:
    """How one model's parameter paths are named in its Hugging Face checkpoint.

    ``leaves`` adds (flax leaf, Hugging Face leaf, stored transposed) entries to ``_LEAVES`` (e.g. stacked
    expert tensors); "transposed" swaps the last two axes. ``rewrite`` maps a checkpoint's stream of
    (name, array) to the tensors the table names (e.g. stacks one tensor per expert, dequantizes MXFP4);
    it must raise a ValueError naming the tensor when the input cannot be converted."""

    prefix: str = ""  # prepended to every tensor name except those starting with ``unprefixed``
    unprefixed: tuple[str, ...] = ("lm_head.",)
    ignored: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)  # regexes: checkpoint tensors with no parameter
    leaves: tuple[tuple[str, str, bool], ...] = ()
    rewrite: Callable[[Iterator[tuple[str, np.ndarray]]], Iterator[tuple[str, np.ndarray]]] | None = None

    def name(self, path: tuple[str, ...]) -> tuple[str, bool]:
        """Flax path -> (Hugging Face tensor name, stored transposed?)."""
        extra = {f: (h, t) for f, h, t in self.leaves}
        leaf, transposed = extra.get(path[-1]) or _LEAVES[path[-1]]
        name = ".".join([re.sub(r"^layers_(\d+)$", r"layers.\1", p) for p in path[:-1]] + [leaf])
        return (name if name.startswith(self.unprefixed) else self.prefix + name), transposed

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignored)


def skip_tensors(skipped: tuple[tuple[str, str], ...], who: str):
    """A ``NameTable.rewrite`` that drops the tensors matching ``skipped``'s (regex, what) pairs (a VL
    checkpoint's vision / audio towers, multi-token prediction) and says on stderr how many of each it dropped."""
    def rewrite(stream):
        counts = {what: 0 for _, what in skipped}
        for name, array in stream:
            what = next((w for p, w in skipped if re.search(p, name)), None)
            if what is None:
                yield name, array
            else:
                counts[what] += 1
        dropped = ", ".join(f"{n} {what} tensors" for what, n in counts.items() if n)
        if dropped:
            print(f"{who}: loaded the language model only; skipped {dropped}", file=sys.stderr)

    return rewrite


def _swap(a, transposed: bool):
    """Our [.., in, out] <-> PyTorch's [.., out, in] (the last two axes)."""
    return np.swapaxes(a, -1, -2) if transposed else a


def resolve_dtype(dtype):
    """A dtype name of ``DTYPES`` (or its short alias: fp32, bf16, fp16), or a dtype -> the jnp scalar type."""
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype, dtype)
        if name not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES) + sorted(_DTYPE_ALIASES)}")
        return DTYPES[name]
    return jnp.dtype(dtype).type


def auto_dtype(directory: str) -> str:
    """``dtype="auto"``: the checkpoint's own dtype (config.json ``dtype`` / ``torch_dtype``) on TPU / GPU, as
    vLLM and MaxText do; float32 on CPU, where bfloat16 / float16 matmuls are emulated (3-4x slower here). A checkpoint
    is only ever read onto this host's own devices, so the default backend is the platform."""
    if jax.default_backend() == "cpu":
        return "float32"
    try:
        with open(os.path.join(directory, "config.json")) as f:
            cfg = json.load(f)
        name = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    except (OSError, ValueError, AttributeError):
        name = None
    return name if name in DTYPES else "float32"


def _offline() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any(str(f).strip().upper() in ("1", "ON", "YES", "TRUE") for f in flags if f is not None)


def resolve_path(path_or_hub_id: str) -> str:
    """A local directory as is; otherwise a Hugging Face hub id through the local cache or the network."""
    path = os.fspath(path_or_hub_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or path.startswith((".", "/")) or path.count("/") != 1:
        raise FileNotFoundError(f"{path!r} is not a directory (nor a Hugging Face hub id like 'org/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise FileNotFoundError(f"{path!r} is not a local directory and huggingface_hub is missing") from e
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
    try:
        return snapshot_download(path, allow_patterns=patterns, local_files_only=True)
    except Exception as e:
        # huggingface_hub reads HF_HUB_OFFLINE once, at its import; honour it as set now.
        if _offline():
            raise FileNotFoundError(
                f"{path!r} is not a local directory nor in the Hugging Face cache, and the hub is offline "
                f"(HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set; {type(e).__name__}). Download it where there is "
                f"network (hf download {path}) or pass a local directory.") from None
    try:
        return snapshot_download(path, allow_patterns=patterns)
    except Exception as e:
        raise FileNotFoundError(
            f"could not get {path!r} from the Hugging Face hub ({type(e).__name__}: {e}); it is not in the local "
            "cache and the hub is unreachable (offline?). Download it where there is network "
            f"(hf download {path}) or pass a local directory.") from None


def _read_header(filename: str) -> tuple[dict, int]:
    """(header, data start) of a safetensors file that the official library validated (a JSON object of
    entries with dtype / shape / data_offsets, offsets contiguous and inside the file, byte lengths
    matching shape x dtype, header size capped); else a ValueError naming the file and the tensor."""
    try:
        with safe_open(filename, framework="numpy"):
            pass
    except Exception as e:  # SafetensorError for malformed files, OSError for unreadable ones
        raise ValueError(f"{filename}: not a valid safetensors file: {_culprit(filename)}{e}") from None
    with open(filename, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _culprit(filename: str) -> str:
    """'tensor NAME: ' for the first entry whose byte range cannot be right, when the header can be read."""
    try:
        with open(filename, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 1 << 27)))
        end, data_size = 0, os.path.getsize(filename) - 8 - n
        for name, info in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                 key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = info["data_offsets"]
            size = np.dtype(_ST_DTYPES[info["dtype"]]).itemsize * int(np.prod(info["shape"]))
            if lo != end or hi - lo != size or hi > data_size:
                return f"tensor {name}: "
            end = hi
    except Exception:
        pass
    return ""


def iter_safetensors(filename: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, memory-mapped array) for every tensor of one file; bf16 through ml_dtypes."""
    header, start = _read_header(filename)
    raw = np.memmap(filename, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{filename}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        yield name, raw[start + lo:start + hi].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_safetensors(filename: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write a safetensors file (any numpy dtype incl. bfloat16)."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


def weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory} "
                            "(only safetensors checkpoints are supported)")


def load_params(directory: str, shapes, table: NameTable, *, dtype=jnp.float32,
                place: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """Read the checkpoint in ``directory`` into a tree shaped like ``shapes`` (a pytree of ShapeDtypeStructs).

    ``dtype``: a name, a dtype or "auto" (``auto_dtype``). Every parameter must be present with the shape
    the config implies; ``place(path, array)`` puts each converted tensor on its device(s) (default:
    ``jnp.asarray``); the table's ignored names are skipped.
    """
    dtype = resolve_dtype(auto_dtype(directory) if dtype == "auto" else dtype)
    place = place or (lambda path, a: jnp.asarray(a))
    expected = {}
    for path, leaf in traverse_util.flatten_dict(shapes).items():
        name, transposed = table.name(path)
        expected[name] = (path, transposed, tuple(leaf.shape))
    found, unexpected, where = {}, [], {}
    files = weight_files(directory)

    def tensors():  # every file's tensors, remembering which file each came from
        for filename in files:
            where["file"] = filename
            yield from iter_safetensors(filename)

    big = sum(os.path.getsize(f) for f in files) > _PROGRESS_BYTES
    bar = progress_bar(len(expected), f"loading {os.path.basename(os.path.normpath(directory))}", "tensor", big)
    stream = tensors()
    for name, array in (table.rewrite(stream) if table.rewrite else stream):
        if name not in expected:
            if not table.is_ignored(name):
                unexpected.append(name)
            continue
        path, transposed, shape = expected[name]
        hf_shape = shape[:-2] + shape[:-3:-1] if transposed else shape
        if tuple(array.shape) != hf_shape:
            raise ValueError(f"{where['file']}: tensor {name} has shape {list(array.shape)} but the config implies "
                             f"{list(hf_shape)}")
        found[path] = place(path, np.asarray(_swap(array, transposed)).astype(dtype))
        bar.update(1)
    bar.close()
    missing = sorted(n for n, (p, _, _) in expected.items() if p not in found)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensors the config needs, e.g. {missing[:5]}")
    if unexpected:
        raise ValueError(f"checkpoint {directory} has {len(unexpected)} tensors this model does not use, "
                         f"e.g. {sorted(unexpected)[:5]} (wrong model_type or config?)")
    return traverse_util.unflatten_dict(found)


def export_params(params, table: NameTable, dtype=None) -> dict[str, np.ndarray]:
    """Parameter tree -> {Hugging Face name: [out, in] array}."""
    out = {}
    for path, value in traverse_util.flatten_dict(params).items():
        name, transposed = table.name(path)
        a = np.asarray(jax.device_get(value))
        if dtype is not None:
            a = a.astype(resolve_dtype(dtype))
        out[name] = np.ascontiguousarray(_swap(a, transposed))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory ``path`` holds tokenizer files (``load_tokenizer`` reads them)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def has_chat_template(path: str) -> bool:
    """Whether the tokenizer files in ``path`` carry a chat template (a chat_template.jinja / .json file, or
    tokenizer_config.json's "chat_template"), read from the files alone, before the tokenizer loads."""
    if any(os.path.isfile(os.path.join(path, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(path: str | None):
    """The target's tokenizer, or None when the checkpoint directory has no tokenizer files
    (transformers would otherwise build an empty one from config.json alone)."""
    if not path or not has_tokenizer(path):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # keep the model usable with token ids, but say why text will not work
        warnings.warn(f"{path} has tokenizer files that transformers cannot load ({type(e).__name__}: {e}); "
                      "text prompts will not work, token ids will", stacklevel=2)
        return None
