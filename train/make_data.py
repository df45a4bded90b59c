"""``python -m train.make_data --target T --prompts-file FILE --out DIR``: training data for a DFlash draft.

By default the TARGET answers the prompts (as in the paper: the draft learns the target's own
distribution), continuously batched through the project's decode engine (``dflash_jax.decode``; plain
decoding, or speculative with ``--draft`` -- lossless, so the same tokens, just faster), greedy or
sampled. A prompt file with ready responses (JSONL ``prompt`` + ``response`` text, or
``prompt_ids`` + ``response_ids``) is tokenized instead; ``--chat`` applies the tokenizer's chat
template. Each sequence is prompt + response with only the response supervised.

Output: ``DIR/manifest.json`` + ``DIR/shard_NNNNN.npz`` (see ``train/data.py``), one shard per
``--shard-size`` prompts. Resumable: rerunning the same command skips the shards already written.

Prompt files (``dflash_jax/prompts.py``, the one reader and encoder of training and serving): one prompt
per line (``\\n`` stands for a newline), or JSONL with a ``prompt`` (text) or ``prompt_ids`` field. Text
prompts are encoded with the tokenizer's special tokens (a LLaMA prompt starts with its BOS), as
``infer.generate`` and ``infer.benchmark`` encode them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

from dflash_jax.checkpoints import load_tokenizer
from dflash_jax.cli_flags import add_dtype_arg, add_renamed, resolve_dtype_arg
from dflash_jax.prompts import encode_prompt, read_prompts
from train.data import (FORMAT, DataError, conversation_turns, encode_conversation, encode_pair, read_manifest,
                        shard_name, write_manifest, write_shard)
from dflash_jax.progress import progress_bar
from dflash_jax.launch import launch


def _file_digest(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.make_data", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint directory or hub id")
    add_renamed(p, "--prompts-file", "--prompts", required=True, help="prompt file: text lines (\\n = newline), or "
                "JSONL with prompt / prompt_ids (and optionally response / response_ids)")
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--responses", choices=["auto", "generate", "use"], default="auto",
                   help="generate: the target answers; use: take the file's responses; auto: use them when "
                        "every record has one, else generate")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompts "
                   "(conversations, records with \"messages\", always use it)")
    p.add_argument("--turns", choices=["last", "all"], default="last",
                   help="conversations the target answers: regenerate only the last assistant turn, or every "
                        "assistant turn (one training sequence each, the history as given); only the "
                        "regenerated turn is supervised")
    p.add_argument("--chat-template-kwargs", default="{}", help="JSON kwargs for apply_chat_template, "
                   "e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--max-new-tokens", type=int, default=512, help="response length limit when generating")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a prompt's key: this seed and the prompt's index in the run)")
    add_renamed(p, "--max-batch", "--batch-size", type=int, default=8,
                help="decode slots: prompts generated together, a finished one's slot refilled at once")
    p.add_argument("--shard-size", type=int, default=256, help="prompts per output shard")
    p.add_argument("--max-prompt-len", type=int, default=0, help="skip prompts longer than this (0: no limit)")
    p.add_argument("--max-length", type=int, default=0, help="cap on prompt + response tokens (0: the target's "
                   "max_position_embeddings)")
    p.add_argument("--draft", default="", help="optional draft to speed up generation (output unchanged)")
    add_dtype_arg(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm progress bar")
    return p


# A manifest's settings by the flags that set them (the rest: "--" + the key, dashed).
_FLAGS = {"chat_kwargs": "--chat-template-kwargs", "batch_size": "--max-batch"}


def _differences(manifest: dict, settings: dict, vocab: int) -> list[str]:
    """What differs between the settings a data directory was made with and this run's, as option names."""
    had = manifest.get("settings") or {}
    out = []
    for k in sorted(set(had) | set(settings)):
        if had.get(k) == settings.get(k):
            continue
        if k == "prompts_sha1":
            out.append("the prompt file's contents")
        else:
            name = _FLAGS.get(k) or "--" + k.replace("_", "-")
            out.append(f"{name} {had.get(k)!r} -> {settings.get(k)!r}")
    if manifest.get("vocab_size") != vocab:
        out.append(f"the target's vocab_size {manifest.get('vocab_size')} -> {vocab}")
    return out


def _responses_mode(records: list[dict], responses: str, prompts: str) -> str:
    """--responses resolved: "auto" is "use" when every record has a response, "generate" when none has."""
    has = ["response" in r or "response_ids" in r for r in records]
    if responses == "auto":
        if all(has):
            return "use"
        if not any(has):
            return "generate"
        raise DataError(f"{prompts}: {sum(has)} of {len(records)} records have a response; pass "
                        "--responses generate (the target answers all) or give every record a response")
    if responses == "use" and not all(h or "messages" in r for h, r in zip(has, records)):
        raise DataError(f"{prompts}: --responses use, but {len(has) - sum(has)} records have no response")
    return responses


def _given_responses(chunk: list[dict], tokenizer, *, chat: bool, chat_kwargs, max_prompt_len: int,
                     max_length: int) -> list[tuple]:
    """[(ids, mask)] of records with their own responses (or conversations); records whose prompt is too long
    or with nothing supervised are left out."""
    seqs = []
    for r in chunk:
        if "messages" in r:
            ids, mask = encode_conversation(r, tokenizer, chat_kwargs)
            first = mask.index(1) if 1 in mask else len(ids)
        else:
            p, resp = encode_pair(r, tokenizer, chat, chat_kwargs)
            ids, mask, first = p + resp, [0] * len(p) + [1] * len(resp), len(p)
        if (max_prompt_len and first > max_prompt_len) or not any(mask):
            continue
        cut = max_length or len(ids)
        seqs.append((np.asarray(ids[:cut], np.int32), np.asarray(mask[:cut], np.uint8)))
    return seqs


def make_data(target, prompts: str, out: str, *, responses: str = "auto", chat: bool = False,
              chat_kwargs: dict | None = None, max_new_tokens: int = 512, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, seed: int = 0, batch_size: int = 8, shard_size: int = 256,
              max_prompt_len: int = 0, max_length: int = 0, draft=None, tokenizer=None, progress: bool = True,
              turns: str = "last", log=print) -> dict:
    """Python API of the command; ``target`` is a loaded ``dflash_jax.target.Target``. Returns the manifest."""
    if batch_size < 1 or shard_size < 1 or max_new_tokens < 1:
        raise ValueError("--max-batch, --shard-size and --max-new-tokens must be >= 1")
    if turns not in ("last", "all"):
        raise ValueError(f"--turns must be last or all, got {turns!r}")
    records = read_prompts(prompts)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target.path)
    responses = _responses_mode(records, responses, prompts)
    if responses == "generate":  # conversations: the target answers the chosen assistant turns
        records = [t for r in records for t in conversation_turns(r, turns)]
    vocab = target.config.vocab_size
    stop_ids = sorted(set(target.config.eos_token_id) | (
        {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else set()))
    settings = {"prompts_sha1": _file_digest(prompts), "responses": responses, "chat": chat,
                "chat_kwargs": chat_kwargs or {}, "shard_size": shard_size, "max_prompt_len": max_prompt_len,
                "max_length": max_length, "turns": turns}
    if responses == "generate":
        settings.update(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, batch_size=batch_size)
    os.makedirs(out, exist_ok=True)
    if os.path.isfile(os.path.join(out, "manifest.json")):
        manifest = read_manifest(out)
        differ = _differences(manifest, settings, vocab)
        if differ:
            raise DataError(f"{out} holds data made with other settings ({'; '.join(differ)}); use the original "
                            "values, or a new --out (or delete it) to start over")
    else:
        manifest = {"format": FORMAT, "version": 1, "vocab_size": vocab, "target": target.path,
                    "prompts": os.path.abspath(prompts), "num_records": len(records), "settings": settings,
                    "stop_token_ids": stop_ids, "shards": [], "complete": False}
    done = {s["file"] for s in manifest["shards"] if os.path.isfile(os.path.join(out, s["file"]))}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    n_shards = -(-len(records) // shard_size)
    todo = [i for i in range(n_shards) if shard_name(i) not in done]
    if len(todo) < n_shards:
        log(f"resuming: {n_shards - len(todo)} of {n_shards} shards already in {out}")
    bar = progress_bar(len(records), "make_data", "prompt", progress, initial=len(records) - sum(
        min(shard_size, len(records) - i * shard_size) for i in todo))
    skipped = 0
    for si in todo:
        chunk = records[si * shard_size:(si + 1) * shard_size]
        if responses == "use":
            seqs = _given_responses(chunk, tokenizer, chat=chat, chat_kwargs=chat_kwargs,
                                    max_prompt_len=max_prompt_len, max_length=max_length)
            skipped += len(chunk) - len(seqs)
        else:
            prompt_ids = [encode_prompt(r, tokenizer, chat, chat_kwargs) for r in chunk]
            keep = [i for i, p in enumerate(prompt_ids) if p and not (max_prompt_len and len(p) > max_prompt_len)]
            skipped += len(chunk) - len(keep)
            seqs = _generate(target, draft, [prompt_ids[i] for i in keep], [si * shard_size + i for i in keep],
                             batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids, max_length=max_length or None,
                             bar=bar)
        for ids, _ in seqs:
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
                raise DataError(f"token ids outside the target vocabulary [0, {vocab}) (tokenizer / target mismatch?)")
        entry = write_shard(os.path.join(out, shard_name(si)), seqs)
        entry["source"] = [si * shard_size, si * shard_size + len(chunk)]
        manifest["shards"].append(entry)
        manifest["shards"].sort(key=lambda s: s["file"])
        manifest["complete"] = len(manifest["shards"]) == n_shards
        write_manifest(out, manifest)
        if responses == "use":
            bar.update(len(chunk))
    bar.close()
    manifest["complete"] = True
    write_manifest(out, manifest)
    n = sum(s["num_sequences"] for s in manifest["shards"])
    t = sum(s["num_tokens"] for s in manifest["shards"])
    sup = sum(s["num_supervised"] for s in manifest["shards"])
    log(f"{out}: {n} sequences, {t} tokens ({sup} supervised) in {len(manifest['shards'])} shards"
        + (f"; skipped {skipped} prompts (empty / too long / no response)" if skipped else ""))
    return manifest


def _generate(target, draft, prompts, records, *, batch_size, max_new_tokens, temperature, top_k, top_p, seed,
              stop_ids, max_length, bar):
    """Target responses for ``prompts`` -> [(prompt + response ids, mask)] in the prompts' order, continuously
    batched through ``batch_size`` slots (a row that ends takes the next prompt at once). A prompt samples with
    the key of (seed, its record's index: the prompt's, or the conversation turn's, in the run's order), so its
    response depends on nothing else: not the prompts beside it, the batch size or the shard it lands in."""
    from dflash_jax.decode import Request, continuous_generate

    if not prompts:
        return []
    requests = [Request(p, stream=r) for p, r in zip(prompts, records)]
    results = continuous_generate(target, draft, requests, max_batch=batch_size, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_ids,
                                  seed=seed, max_length=max_length, warm=False, on_result=lambda i, r: bar.update(1))
    return [(np.asarray(r.output_ids, np.int32), np.asarray([0] * r.prompt_length + [1] * r.num_generated, np.uint8))
            for r in results]


def main(argv=None) -> int:
    launch()
    a = build_parser().parse_args(argv)
    try:
        chat_kwargs = json.loads(a.chat_template_kwargs)
    except json.JSONDecodeError as e:
        print(f"error: --chat-template-kwargs is not JSON ({e})", file=sys.stderr)
        return 2
    try:
        from dflash_jax.target import load_target

        dtype = resolve_dtype_arg(a.dtype, a.target)
        target = load_target(a.target, dtype=dtype)
        draft = None
        if a.draft:
            from dflash_jax.drafts.model import load_draft

            draft = load_draft(a.draft, dtype=dtype)
        make_data(target, a.prompts_file, a.out, responses=a.responses, chat=a.chat, chat_kwargs=chat_kwargs,
                  max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                  seed=a.seed, batch_size=a.max_batch, shard_size=a.shard_size, max_prompt_len=a.max_prompt_len,
                  max_length=a.max_length, draft=draft, progress=a.progress, turns=a.turns)
    except (DataError, OSError, ValueError) as e:  # bad input: exit 2, as argparse and the infer CLIs
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
