"""Training data on disk: sharded token ids + loss masks with a manifest; prompt + response pairs; batching.

Layout of a data directory (written by ``python -m train.make_data``)::

    manifest.json        {"format": "dflash-jax-train-data", "version": 1, "vocab_size": V,
                          "shards": [{"file": "shard_00000.npz", "num_sequences": n, "num_tokens": t,
                                      "num_supervised": s, "source": [first, end]}, ...], ...}
    shard_00000.npz      input_ids int32 [t] (all sequences concatenated), loss_mask uint8 [t]
                         (1 = supervised: the response), offsets int64 [n + 1]

A sequence is prompt + response; only the response is supervised. ``TrainData`` loads a directory,
truncates to ``seq_len``, drops sequences that cannot train (with a count), packs the sequences into
rows of ``seq_len`` tokens (best-fit decreasing, once; ``pack=False``: one sequence per row) and
serves padded rows in a per-epoch order that depends only on (seed, epoch), so a resumed run sees
exactly the batches the interrupted one would have.
"""
from __future__ import annotations

import bisect
import json
import os
import warnings
from dataclasses import dataclass

import numpy as np

from dflash_jax.prompts import PromptError, chat_ids, encode_prompt, token_ids

FORMAT = "dflash-jax-train-data"
MANIFEST = "manifest.json"


class DataError(PromptError):
    """Bad training data: missing, empty or malformed files, unusable sequences (a ``PromptError``, so
    one ``except`` covers the data and the prompt files it is made from)."""


# --- writing ------------------------------------------------------------------------------------


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.npz"


def write_shard(path: str, sequences: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Write (ids, loss_mask) pairs to one .npz atomically (tmp + rename); return its manifest entry."""
    lens = [len(ids) for ids, _ in sequences]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = np.concatenate([np.asarray(i, np.int32) for i, _ in sequences]) if sequences else np.zeros(0, np.int32)
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in sequences]) if sequences else np.zeros(0, np.uint8)
    tmp = path + ".tmp.npz"
    np.savez(tmp, input_ids=ids, loss_mask=mask, offsets=offsets)
    os.replace(tmp, path)
    return {"file": os.path.basename(path), "num_sequences": len(sequences), "num_tokens": int(offsets[-1]),
            "num_supervised": int(mask.sum())}


def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``directory/manifest.json`` atomically (tmp + rename): a reader never sees half of one."""
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def load_manifest(directory: str, fmt: str, fix: str = "") -> dict:
    """``directory/manifest.json``, checked to be a ``fmt`` manifest (a "format" and a "shards" list);
    a ``DataError`` naming the file (and ``fix``, what to do about it) otherwise."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e}){fix}") from None
    if not text.strip():
        raise DataError(f"{path} is empty{fix}")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}){fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or not isinstance(
            manifest.get("shards"), list):
        raise DataError(f"{path} is not a {fmt} manifest (needs \"format\": \"{fmt}\" and a \"shards\" list){fix}")
    return manifest


def read_manifest(data_dir: str) -> dict:
    """The manifest of a data directory written by ``python -m train.make_data``."""
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir!r} does not exist (write one with `python -m train.make_data`)")
    if not os.path.isfile(os.path.join(data_dir, MANIFEST)):
        raise DataError(f"{os.path.join(data_dir, MANIFEST)} is missing: {data_dir!r} is not a data directory "
                        "written by `python -m train.make_data`")
    return load_manifest(data_dir, FORMAT)


def read_shard(path: str, vocab_size: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """One shard -> list of (ids int32, loss_mask uint8), validated."""
    if not os.path.isfile(path):
        raise DataError(f"shard {path} listed in the manifest is missing")
    if os.path.getsize(path) == 0:
        raise DataError(f"shard {path} is empty (0 bytes)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("input_ids", "loss_mask", "offsets")}
    except KeyError as e:
        raise DataError(f"shard {path} lacks the array {e.args[0]} (needs input_ids, loss_mask, offsets)") from None
    except Exception as e:  # zipfile / format errors
        raise DataError(f"shard {path} is not a readable .npz file ({type(e).__name__}: {e})") from None
    ids, mask, off = arrays["input_ids"], arrays["loss_mask"], arrays["offsets"]
    if ids.ndim != 1 or mask.shape != ids.shape or off.ndim != 1 or len(off) < 1:
        raise DataError(f"shard {path}: input_ids {ids.shape} / loss_mask {mask.shape} / offsets {off.shape} "
                        "must be 1-D with equal lengths")
    if not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"shard {path}: input_ids must be integers, got {ids.dtype}")
    if off[0] != 0 or off[-1] != len(ids) or np.any(np.diff(off) < 0):
        raise DataError(f"shard {path}: offsets must rise from 0 to len(input_ids)={len(ids)}")
    if len(ids) and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise DataError(f"shard {path}: token ids outside the target vocabulary [0, {vocab_size}): "
                        f"min {ids.min()}, max {ids.max()} (data made for another target?)")
    if len(mask) and not np.isin(np.unique(mask), (0, 1)).all():
        raise DataError(f"shard {path}: loss_mask must be 0/1")
    ids, mask = ids.astype(np.int32), mask.astype(np.uint8)
    return [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]


# --- prompt / response pairs ----------------------------------------------------------------------


def encode_pair(record: dict, tokenizer, chat: bool, chat_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """A record with a ready response -> (prompt ids, response ids)."""
    prompt = encode_prompt(record, tokenizer, chat, chat_kwargs)
    if "response_ids" in record:
        return prompt, list(record["response_ids"])
    if "response" not in record:
        raise DataError("a record has no \"response\" / \"response_ids\"; use --generate (the default when the "
                        "file has no responses) to have the target answer the prompts")
    if tokenizer is None:
        raise DataError("text responses need the target's tokenizer, and the target directory has none")
    if chat and "prompt" in record:
        full = chat_ids(tokenizer, [{"role": "user", "content": record["prompt"]},
                                    {"role": "assistant", "content": record["response"]}], chat_kwargs)
        if full[:len(prompt)] == prompt and len(full) > len(prompt):
            return prompt, full[len(prompt):]
    resp = token_ids(tokenizer(record["response"], add_special_tokens=False))
    eos = tokenizer.eos_token_id
    return prompt, resp + ([eos] if eos is not None else [])


def conversation_turns(record: dict, turns: str) -> list[dict]:
    """A conversation -> prompt records for the target to answer: the history before each assistant turn
    (``turns="all"``) or before the last one (``"last"``); a conversation ending with the user's turn is
    one prompt as it is. Other records pass through."""
    if "messages" not in record:
        return [record]
    msgs = record["messages"]
    cuts = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and any(x["role"] == "user" for x in msgs[:i])]
    if msgs[-1]["role"] == "user":
        cuts.append(len(msgs))
    if turns == "last":
        cuts = cuts[-1:]
    return [{"messages": msgs[:i]} for i in cuts]


def encode_conversation(record: dict, tokenizer, chat_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """A conversation as given -> (ids, loss mask): the whole chat template, only the assistant turns
    supervised. Each assistant span is where the template of the conversation up to that turn extends
    the template of the history with the assistant's turn opened; a template whose earlier turns change
    when later ones are added (e.g. one that drops earlier reasoning) cannot be cut that way: an error."""
    msgs = record["messages"]
    full = chat_ids(tokenizer, msgs, chat_kwargs)
    mask = [0] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = chat_ids(tokenizer, msgs[:i], chat_kwargs, add_generation_prompt=True)
        end = chat_ids(tokenizer, msgs[:i + 1], chat_kwargs)
        if full[:len(start)] != start or full[:len(end)] != end or len(end) <= len(start):
            raise DataError(f"the chat template does not extend turn by turn at assistant message {i} of "
                            f"{str(msgs[0]['content'])[:40]!r}...; give the conversation to the target to answer "
                            "(--responses generate) instead")
        mask[len(start):len(end)] = [1] * (len(end) - len(start))
    return full, mask


# --- loading for training -------------------------------------------------------------------------


def incomplete_data(data_dir: str, manifest: dict) -> str | None:
    """None when ``manifest`` is complete (or predates the "complete" flag); else what is missing, e.g.
    "12 of 24 prompt records (shards 2..3 of 4) were never written"."""
    if manifest.get("complete") is not False:
        return None
    total = manifest.get("num_records")
    done = 0
    for entry in manifest["shards"]:
        src = entry.get("source") if isinstance(entry, dict) else None
        if isinstance(src, (list, tuple)) and len(src) == 2:
            done += int(src[1]) - int(src[0])
    written = sum(int(e.get("num_sequences", 0)) for e in manifest["shards"] if isinstance(e, dict))
    shard_size = (manifest.get("settings") or {}).get("shard_size")
    what = (f"{total - done} of {total} prompt records were never written" if isinstance(total, int)
            else "an unknown number of prompt records were never written")
    if isinstance(total, int) and isinstance(shard_size, int) and shard_size > 0:
        what += f" ({-(-total // shard_size) - len(manifest['shards'])} of {-(-total // shard_size)} shards missing)"
    return (f"{data_dir} is incomplete (its make_data run was interrupted: manifest \"complete\": false): {what}, "
            f"only {written} sequences are there; rerun the same `python -m train.make_data` command to finish it, "
            "or pass --allow-partial-data to train on what is there")


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of the n sequences used in ``epoch`` (depends only on seed and epoch)."""
    return np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(n)


def pack_sequences(lengths, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: sequence indices grouped into rows of at most ``capacity`` tokens (each length
    <= capacity); longest first, each into the fullest row it fits, ties by index (deterministic)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k < len(free):
            room, r = free.pop(k)
            rows[r].append(i)
        else:
            room, r = capacity, len(rows)
            rows.append([i])
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], r))
    return rows


def padding_fraction(num_tokens: int, num_rows: int, seq_len: int) -> float:
    """Share of the ``num_rows`` x ``seq_len`` token slots that are padding."""
    return 1.0 - num_tokens / max(num_rows * seq_len, 1)


def num_anchor_positions(mask: np.ndarray) -> int:
    """Positions a with mask[a] and mask[a+1] (the anchor and its next token supervised)."""
    return int(np.sum(mask[:-1].astype(bool) & mask[1:].astype(bool))) if len(mask) > 1 else 0


@dataclass
class TrainData:
    """All training sequences (truncated to seq_len, unusable ones dropped), their rows and the batch order.

    An example (what a batch index names) is a row: several packed sequences, or one when ``rows`` is None."""

    ids: list  # per sequence int32 [len <= seq_len]
    masks: list  # per sequence uint8
    source: list  # (shard index, index in shard) of each kept sequence
    seq_len: int
    manifest: dict
    rows: list | None = None  # packed: the sequence indices of each row

    @classmethod
    def load(cls, data_dir: str, *, seq_len: int, block_size: int, vocab_size: int | None = None,
             verbose: bool = True, allow_partial: bool = False, pack: bool = False) -> "TrainData":
        """Refuses (``DataError``) a directory whose make_data run did not finish unless ``allow_partial``
        (then warns with the number of missing records). ``pack``: rows of several sequences."""
        manifest = read_manifest(data_dir)
        if not manifest["shards"]:
            raise DataError(f"{data_dir}/manifest.json lists no shards (no data was written?)")
        partial = incomplete_data(data_dir, manifest)
        if partial and not allow_partial:
            raise DataError(partial)
        if partial and verbose:
            warnings.warn(partial.split("; rerun")[0] + "; training on them (--allow-partial-data)", stacklevel=2)
        if vocab_size is not None and manifest.get("vocab_size") not in (None, vocab_size):
            raise DataError(f"data in {data_dir} was made for a vocabulary of {manifest['vocab_size']} tokens, "
                            f"the target has {vocab_size} (data from another target?)")
        ids, masks, source = [], [], []
        total = short = unsupervised = truncated = 0
        for si, entry in enumerate(manifest["shards"]):
            if not isinstance(entry, dict) or "file" not in entry:
                raise DataError(f"{data_dir}/manifest.json: shard entry {si} has no \"file\"")
            for j, (x, m) in enumerate(read_shard(os.path.join(data_dir, entry["file"]), vocab_size)):
                total += 1
                if len(x) > seq_len:
                    truncated += 1
                    x, m = x[:seq_len], m[:seq_len]
                if len(x) < block_size:
                    short += 1
                    continue
                if num_anchor_positions(m) == 0:
                    unsupervised += 1
                    continue
                ids.append(x)
                masks.append(m)
                source.append((si, j))
        if total == 0:
            raise DataError(f"data in {data_dir} has no sequences")
        dropped = short + unsupervised
        msg = (f"{short} of {total} sequences are shorter than a block ({block_size} tokens) and "
               f"{unsupervised} have no two consecutive supervised tokens within --seq-len {seq_len}")
        if not ids:
            raise DataError(f"no usable training sequence in {data_dir}: {msg}")
        if dropped and verbose:
            warnings.warn(f"dropped {dropped} sequences: {msg}", stacklevel=2)
        if truncated and verbose:
            warnings.warn(f"{truncated} of {total} sequences are longer than --seq-len {seq_len} and were truncated",
                          stacklevel=2)
        rows = pack_sequences([len(x) for x in ids], seq_len) if pack else None
        return cls(ids, masks, source, seq_len, manifest, rows)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_rows(self) -> int:
        return len(self) if self.rows is None else len(self.rows)

    def row(self, i: int) -> list[int]:
        """The sequence indices of row (example) ``i``."""
        return [int(i)] if self.rows is None else self.rows[i]

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))

    def tokens(self, indices) -> int:
        """Sequence tokens in the rows ``indices``."""
        return int(sum(len(self.ids[j]) for i in np.asarray(indices).reshape(-1) for j in self.row(i)))

    def packing_summary(self) -> str:
        """E.g. "packed 1234 sequences into 321 rows of 3072: padding 71% -> 6%" (one sequence per row -> packed)."""
        before = padding_fraction(self.num_tokens, len(self), self.seq_len)
        after = padding_fraction(self.num_tokens, self.num_rows, self.seq_len)
        return (f"packed {len(self)} sequences into {self.num_rows} rows of {self.seq_len}: padding "
                f"{before:.0%} -> {after:.0%}")

    def steps_per_epoch(self, global_batch: int) -> int:
        n = self.num_rows // global_batch
        if n == 0:
            what = "usable sequences" if self.rows is None else f"rows of packed sequences ({len(self)} sequences)"
            raise DataError(f"the data has {self.num_rows} {what}, fewer than one optimizer step's "
                            f"batch_size x grad_accum = {global_batch}")
        return n

    def step_indices(self, step: int, *, seed: int, grad_accum: int, batch_size: int) -> tuple[int, np.ndarray]:
        """(epoch, example (row) indices [grad_accum, batch_size]) of optimizer step ``step`` (0-based)."""
        g = grad_accum * batch_size
        spe = self.steps_per_epoch(g)
        epoch, pos = divmod(step, spe)
        order = epoch_order(seed, epoch, self.num_rows)
        return epoch, order[pos * g:(pos + 1) * g].reshape(grad_accum, batch_size)

    def sequences(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Padded (ids int32, loss_mask int32) of the SEQUENCES ``indices``, shape indices.shape + [seq_len];
        padding is 0 / unsupervised."""
        ids, mask, _ = self._fill([[int(i)] for i in np.asarray(indices).reshape(-1)])
        shape = tuple(np.shape(indices)) + (self.seq_len,)
        return ids.reshape(shape), mask.reshape(shape)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids int32, loss_mask int32, doc_start int32 or None) of the rows ``indices``, each indices.shape +
        [seq_len]: a row's sequences one after the other, then padding (0 / unsupervised). ``doc_start``
        (packed data only): the row position where each token's sequence starts (the padding after the
        last one counts as one more)."""
        ids, mask, start = self._fill([self.row(i) for i in np.asarray(indices).reshape(-1)])
        shape = tuple(np.shape(indices)) + (self.seq_len,)
        return ids.reshape(shape), mask.reshape(shape), None if self.rows is None else start.reshape(shape)

    def _fill(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.zeros((len(rows), self.seq_len), np.int32)
        mask = np.zeros((len(rows), self.seq_len), np.int32)
        start = np.zeros((len(rows), self.seq_len), np.int32)
        for r, seqs in enumerate(rows):
            at = 0
            for j in seqs:
                n = len(self.ids[j])
                ids[r, at:at + n], mask[r, at:at + n], start[r, at:at + n] = self.ids[j], self.masks[j], at
                at += n
            start[r, at:] = at
        return ids, mask, start
