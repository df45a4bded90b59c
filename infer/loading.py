"""Loading the target and draft a CLI names, after every check the configs alone allow (options, prompts, the
pair's fit), so that a bad run fails in one line before seconds or minutes of weight loading."""
from __future__ import annotations

import os
import sys

from dflash_jax.checkpoints import has_chat_template, has_tokenizer, resolve_path
from dflash_jax.cli_flags import resolve_dtype_arg
from dflash_jax.demo import DEMO_DIR, DEMO_DRAFT, DEMO_TARGET
from infer.flags import FLAGS, adaptive_kwargs, die, draft_kwargs, fixed_block_size, stop_ids


def load_models(args, prompts: list[dict] = ()):
    """(target, draft or None, tokenizer or None) from the parsed options; ``prompts``: the run's prompt records
    (``{"prompt": text}`` / ``{"prompt_ids": ids}`` / ``{"messages": ...}``), checked against the target's config
    and tokenizer files before any weight loads."""
    import dflash_jax as dj
    from dflash_jax import sharding
    from dflash_jax.checkpoints import load_tokenizer
    from dflash_jax.decode.memory import param_dtype

    # one process of a multi-host launch: before anything touches the backend (auto_dtype asks for it)
    sharding.maybe_initialize_distributed()
    target_path = args.target or DEMO_TARGET
    draft_path = args.draft
    if args.target is None:
        if not os.path.isfile(os.path.join(DEMO_TARGET, "config.json")):
            die(f"the embedded demo pair is missing ({DEMO_DIR}); pass --target and --draft")
        draft_path = draft_path or DEMO_DRAFT
    try:
        check_before_loading(args, target_path, draft_path, prompts)
        dtype = resolve_dtype_arg(args.dtype, target_path)
        if getattr(args, "mesh", None):
            from dflash_jax import model_sharding

            target, draft = model_sharding.load_sharded(target_path, draft_path, sharding.make_mesh(args.mesh), dtype,
                                                        scan_layers=args.scan_layers)
        else:
            target = dj.load_target(target_path, dtype=dtype, scan_layers=args.scan_layers)
            draft = dj.load_draft(draft_path, dtype=dtype) if draft_path else None
        if draft is not None:
            from dflash_jax.drafts.model import check_pair
            check_pair(target, draft)
    except (OSError, ValueError) as e:  # missing / unreadable files, malformed checkpoints and configs
        die(str(e))
    scan = ", layers scanned" if target.config.scan_layers else ""
    print(f"target {target.path} ({target.config.model_type}, {param_dtype(target)}{scan})"
          + (f", draft {draft.path} ({param_dtype(draft)})" if draft is not None else ", no draft: plain decoding"),
          file=sys.stderr)
    return target, draft, load_tokenizer(target.path)


def check_before_loading(args, target_path: str, draft_path: str | None, prompts: list[dict] = ()) -> None:
    """Every option and prompt that the configs alone can check, before seconds (or minutes) of weight loading."""
    import warnings

    from dflash_jax.decode.options import DecodeOptions, check_tree_target, option_names
    from dflash_jax.drafts import DraftConfig
    from dflash_jax.families import config_from_hf

    try:
        with option_names(FLAGS):  # the library's own checks (sampling settings too), naming the flags
            options = DecodeOptions(max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, acceptance=args.acceptance,
                                    block_size=fixed_block_size(args), **adaptive_kwargs(args), **draft_kwargs(args))
    except ValueError as e:
        die(str(e))
    target_dir = resolve_path(target_path)
    tcfg = config_from_hf(target_dir)
    check_prompt_records(prompts, tcfg.vocab_size, target_dir, getattr(args, "chat", False))
    vocab = tcfg.vocab_size
    bad = [i for i in stop_ids(args, tcfg) if not 0 <= i < vocab]
    if bad:
        die(f"--stop-token-ids {bad} are outside the target vocabulary [0, {vocab})")
    dcfg = None if draft_path is None else DraftConfig.from_hf(resolve_path(draft_path))
    if dcfg is not None:
        with warnings.catch_warnings():  # the full check (and its warnings) runs again once the weights are in
            warnings.simplefilter("ignore")
            dcfg.check_fits(tcfg)
    try:
        with option_names(FLAGS):
            block = options.check_draft(dcfg)
            if options.tree_budget and dcfg is not None:
                check_tree_target(tcfg, block)
    except ValueError as e:
        die(str(e))


def check_prompt_records(prompts: list[dict], vocab: int, target_dir: str, chat: bool) -> None:
    """Dies naming the first prompt (its index in the run) that cannot run: empty, ids outside the vocabulary, text
    without the target's tokenizer, a chat (``--chat``, ``messages``) without its chat template."""
    for i, r in enumerate(prompts):
        ids = r.get("prompt_ids")
        if r.get("prompt") == "" or ids == []:
            die(f"prompt {i} is empty")
        bad = sorted({t for t in ids or () if not 0 <= t < vocab})
        if bad:
            die(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    text = [i for i, r in enumerate(prompts) if "prompt_ids" not in r]
    if text and not has_tokenizer(target_dir):
        die(f"prompt {text[0]} is text, and the target directory {target_dir} has no tokenizer; give token ids "
            "instead (--prompt-ids, or JSONL with a \"prompt_ids\" field)")
    chats = [i for i in text if chat or "messages" in prompts[i]]
    if chats and not has_chat_template(target_dir):
        die(f"prompt {chats[0]} needs a chat template ({'--chat' if chat else 'messages'}), and the target's "
            f"tokenizer in {target_dir} has none")
