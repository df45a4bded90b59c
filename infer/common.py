"""Options, model loading and prompt reading shared by ``infer.generate`` and ``infer.benchmark``."""
from __future__ import annotations

import argparse
import os
import sys

from dflash_jax.checkpoints import DTYPES
from dflash_jax.demo import DEMO_DIR, DEMO_DRAFT, DEMO_TARGET
from dflash_jax.prompts import PromptError, encode_prompt, read_prompts


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="Hugging Face Qwen3/LLaMA target: directory or hub id (default: embedded demo)")
    g.add_argument("--draft", help="DFlash draft: directory or hub id (default: embedded demo draft when the "
                                   "target is the demo; none otherwise = plain decoding)")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="parameter/compute dtype (default float32)")
    g.add_argument("--mesh", default=None,
                   help="shard over devices: 'data=2,tensor=4' (axes data, fsdp, expert, tensor; omitted = 1, one "
                        "may be -1 = the rest) or 'auto' (all devices on data). Params tensor-parallel (MoE experts "
                        "over expert), prompts and caches data-parallel. Multi-host: set DFLASH_DISTRIBUTED=1 (TPU "
                        "pods) or JAX_COORDINATOR_ADDRESS. Default: one device")
    d = p.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--max-length", type=int, default=None,
                   help="cap on prompt + generated tokens per row (default: target max_position_embeddings)")
    d.add_argument("--block-size", type=int, default=None, help="draft block size (default: the draft's trained one)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    d.add_argument("--top-k", type=int, default=0, help="0 = off")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--stop-token-ids", default=None,
                   help="comma-separated stop ids (default: the target's eos_token_id)")
    d.add_argument("--ignore-eos", action="store_true", help="no stop tokens: always generate max-new-tokens")


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load_models(args):
    """(target, draft or None, tokenizer or None) from the parsed options."""
    import dflash_jax as dj
    from dflash_jax.checkpoints import load_tokenizer

    target_path = args.target or DEMO_TARGET
    draft_path = args.draft
    if args.target is None:
        if not os.path.isfile(os.path.join(DEMO_TARGET, "config.json")):
            die(f"the embedded demo pair is missing ({DEMO_DIR}); pass --target and --draft")
        draft_path = draft_path or DEMO_DRAFT
    try:
        if getattr(args, "mesh", None):
            from dflash_jax import sharding

            sharding.maybe_initialize_distributed()
            target, draft = sharding.load_sharded(target_path, draft_path, sharding.make_mesh(args.mesh), args.dtype)
        else:
            target = dj.load_target(target_path, dtype=args.dtype)
            draft = dj.load_draft(draft_path, dtype=args.dtype) if draft_path else None
        if draft is not None:
            from dflash_jax.draft import check_fits
            check_fits(target, draft)
    except (FileNotFoundError, ValueError) as e:
        die(str(e))
    return target, draft, load_tokenizer(target.path)


def stop_ids(args, target) -> list[int]:
    if args.ignore_eos:
        return []
    if args.stop_token_ids:
        return [int(x) for x in args.stop_token_ids.split(",") if x.strip()]
    return list(target.config.eos_token_id)


def read_prompts_file(path: str) -> list[dict]:
    """The records of a prompts file (``dflash_jax.prompts.read_prompts``); a bad file exits with its message."""
    try:
        return read_prompts(path)
    except PromptError as e:
        die(str(e))


def encode(tokenizer, records: list[dict], chat: bool = False) -> list[list[int]]:
    """Prompt ids of ``records`` by the one rule of ``dflash_jax.prompts`` (as training encodes them); a
    prompt that cannot be encoded, or encodes to no tokens, exits with the reason."""
    out = []
    for r in records:
        try:
            ids = encode_prompt(r, tokenizer, chat)
        except PromptError as e:
            die(str(e))
        if not ids:
            die(f"prompt {r.get('prompt', r.get('prompt_ids'))!r} encodes to no tokens")
        out.append(ids)
    return out
