"""A CLI's prompts: a prompts file read, records encoded to ids, per-prompt settings checked, and the ``decode.Request``
of each."""
from __future__ import annotations

from dflash_jax.prompts import PromptError, encode_prompt, read_prompts
from infer.flags import die


def read_prompts_file(path: str) -> list[dict]:
    """The records of a prompts file (``dflash_jax.prompts.read_prompts``); a bad file exits with its message."""
    try:
        return read_prompts(path)
    except PromptError as e:
        die(str(e))


def encode(tokenizer, records: list[dict], chat: bool = False, chat_kwargs: dict | None = None) -> list[list[int]]:
    """Prompt ids of ``records`` by the one rule of ``dflash_jax.prompts`` (as training encodes them; ``chat_kwargs``:
    the chat template's variables); a prompt that cannot be encoded, or encodes to no tokens, exits with the reason."""
    out = []
    for r in records:
        try:
            ids = encode_prompt(r, tokenizer, chat, chat_kwargs)
        except PromptError as e:
            die(str(e))
        if not ids:
            die(f"prompt {r.get('prompt', r.get('prompt_ids'))!r} encodes to no tokens")
        out.append(ids)
    return out


def check_overrides(args, overrides: list[dict]) -> None:
    """Every prompt's own settings over the command line's, checked before loading (dies naming the prompt)."""
    from dflash_jax.decode import DecodeOptions

    if args.max_batch is not None and args.max_batch < 1:
        die(f"--max-batch must be >= 1, got {args.max_batch}")
    base = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, acceptance=args.acceptance)
    for i, own in enumerate(overrides):
        if own:
            try:
                DecodeOptions(**dict(base, **own))
            except ValueError as e:
                die(f"prompt {i}: {e}")


def requests_of(prompts: list[list[int]], overrides: list[dict]) -> list:
    """``decode.Request`` per prompt: its own settings, and its key stream (its index; 0 with its own seed, so a
    seeded row draws the same tokens wherever it is in the file)."""
    from dflash_jax.decode import Request

    return [Request(p, stream=0 if "seed" in own else i, **own) for i, (p, own) in enumerate(zip(prompts, overrides))]
