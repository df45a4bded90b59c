"""Prompt files and prompt encoding: one reader and one encoder for serving (``infer``) and training (``train``).

A prompts file is JSONL (a ``.jsonl`` / ``.json`` name, or a first line starting with ``{``): one object
per line with ``prompt`` (text) or ``prompt_ids`` (token ids), optionally ``response`` /
``response_ids``; or a conversation, ``messages``: [{"role": "system" | "user" | "assistant", "content":
text}, ...] (ShareGPT / UltraChat style), always encoded with the chat template. Otherwise it is plain
text: one prompt per line, in which the two characters ``\\n`` stand for a newline (JSONL carries any text
exactly). Either kind is UTF-8 with no blank line before its last prompt (dropping one would shift the later
prompts' indices in the outputs). A JSONL row may carry decoding settings of its own (``OVERRIDES``:
max_new_tokens, temperature, top_p, top_k, seed), which ``infer.generate`` / ``infer.benchmark`` take over the
command line's.

The special-tokens rule, the same everywhere (as Hugging Face ``generate`` users and vLLM encode): a
text prompt is ``tokenizer(text)``, with the tokenizer's special tokens (a LLaMA prompt starts with
its BOS); a chat prompt is ``apply_chat_template(..., tokenize=True)``, which inserts whatever BOS the
template has and gets no second one. Token ids are used as given.
"""
from __future__ import annotations

import json
import os


OVERRIDES = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int}


class PromptError(ValueError):
    """A prompts file or a prompt that cannot be read or encoded; the message says what to fix."""


def read_prompts(path: str) -> list[dict]:
    """The records of a prompts file (see the module docstring): ``{"prompt": text}`` per text line."""
    lines = read_lines(path)
    if not (path.endswith((".jsonl", ".json")) or lines[0].lstrip().startswith("{")):
        return [{"prompt": ln.replace("\\n", "\n")} for ln in lines]
    records = []
    for n, ln in enumerate(lines, 1):
        try:
            r = json.loads(ln)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path} line {n} is not valid JSON ({e}); expected one object per line with a "
                              "\"prompt\" (or \"prompt_ids\") field") from None
        if not isinstance(r, dict) or not ({"prompt", "prompt_ids", "messages"} & r.keys()):
            raise PromptError(f"{path} line {n}: expected an object with a \"prompt\", \"prompt_ids\" or "
                              f"\"messages\" field, got {ln[:80]!r}")
        if "messages" in r:
            check_messages(r["messages"], f"{path} line {n}")
        for key in ("prompt", "response"):
            if key in r and not isinstance(r[key], str):
                raise PromptError(f"{path} line {n}: {key} must be a string")
        for key in ("prompt_ids", "response_ids"):
            if key in r and not (isinstance(r[key], list) and all(isinstance(t, int) for t in r[key])):
                raise PromptError(f"{path} line {n}: {key} must be a list of integers")
        for key, kind in OVERRIDES.items():
            if key in r and (not isinstance(r[key], kind) or isinstance(r[key], bool)):
                raise PromptError(f"{path} line {n}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {r[key]!r}")
        records.append(r)
    return records


def read_lines(path: str) -> list[str]:
    """The lines of a prompts file, each a prompt: a blank line before the last prompt is refused (dropping it
    would shift every later prompt's index, so outputs would no longer match lines); trailing ones are ignored."""
    if not os.path.isfile(path):
        raise PromptError(f"prompt file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except UnicodeDecodeError as e:
        raise PromptError(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise PromptError(f"prompt file {path} is empty")
    blank = next((n for n, ln in enumerate(lines, 1) if not ln.strip()), None)
    if blank is not None:
        raise PromptError(f"{path} line {blank} is blank: one prompt per line (write \\n for a newline inside a "
                          "prompt)")
    return lines


ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str) -> None:
    """A conversation: a non-empty list of {"role", "content"} objects with known roles and text content."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise PromptError(f"{where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": "
                              f"text}}, got {str(m)[:80]!r}")


def token_ids(encoded) -> list[int]:
    """Plain ids from what a tokenizer returns (a list, a BatchEncoding / dict, an array, one batch row)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def chat_ids(tokenizer, messages: list[dict], chat_kwargs: dict | None = None, **kw) -> list[int]:
    """``messages`` through the tokenizer's chat template (its own special tokens, nothing added)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("chat prompts need a chat template, and the target's tokenizer has none")
    return token_ids(tokenizer.apply_chat_template(messages, tokenize=True, **kw, **(chat_kwargs or {})))


def encode_prompt(record: dict, tokenizer, chat: bool = False, chat_kwargs: dict | None = None) -> list[int]:
    """A record's prompt ids by the one rule: ``prompt_ids`` as given, ``messages`` through the chat template
    with the assistant's turn opened, else the text with special tokens (``chat``: as the user turn of the
    chat template)."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    if "messages" in record:
        if tokenizer is None:
            raise PromptError("conversations need the target's tokenizer (its chat template)")
        return chat_ids(tokenizer, record["messages"], chat_kwargs, add_generation_prompt=True)
    if tokenizer is None:
        raise PromptError("text prompts need the target's tokenizer, and the target directory has none; give "
                          "token ids instead (JSONL with a \"prompt_ids\" field, or infer.generate --prompt-ids)")
    if chat:
        return chat_ids(tokenizer, [{"role": "user", "content": record["prompt"]}], chat_kwargs,
                        add_generation_prompt=True)
    return token_ids(tokenizer(record["prompt"]))
