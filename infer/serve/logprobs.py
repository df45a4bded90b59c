"""Log-probabilities of a finished request's tokens: one scoring forward of the target over prompt + answer (no
cache; every position's logits: ``dflash_jax.scoring``'s core), after the request finishes, off the engine thread.

What is reported: the log-softmax of the target's raw logits (before temperature, top-k and top-p), as vLLM's
default (``logprobs_mode: raw_logprobs``): the target's own distribution at each position, whatever the request
sampled with and whatever the draft proposed. Position t's value is log p(token t | tokens before it); a prompt's
first token has none (null). The decoding is untouched: a request that asks for no logprobs costs nothing."""
from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from dflash_jax.scoring import next_token_logps, padded
from dflash_jax.target import Target
from infer.serve.protocol import MAX_LOGPROBS


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def _score(cfg, params, ids, k: int):
    """ids [1, L] -> (log p of ids[t] given ids[:t] for t in 1..L-1 [L-1], the top k log-probabilities [L-1, k]
    and their ids [L-1, k]) from the raw logits of one causal forward."""
    logp, chosen = next_token_logps(cfg, params, ids)
    top, top_ids = jax.lax.top_k(logp[0], k)
    return chosen[0], top, top_ids


class Scorer:
    """Scores token sequences with ``target`` (one forward at a time) and writes the OpenAI logprobs objects."""

    def __init__(self, target: Target, tokenizer):
        self.target, self.tokenizer = target, tokenizer
        self._lock = threading.Lock()
        self._texts: dict[int, str] = {}

    def score(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chosen [T-1], top [T-1, MAX_LOGPROBS], top_ids [T-1, MAX_LOGPROBS]) of ``ids`` (T tokens): entry t-1
        is position t's. Causal: the padding after the ids changes none of their values."""
        n = len(ids)
        if n < 2:
            return np.zeros(0, np.float32), np.zeros((0, MAX_LOGPROBS), np.float32), np.zeros((0, MAX_LOGPROBS), int)
        with self._lock:
            chosen, top, top_ids = _score(self.target.config, self.target.params, padded(self.target.config, [ids]),
                                          k=min(MAX_LOGPROBS, self.target.config.vocab_size))
            return np.asarray(chosen)[:n - 1], np.asarray(top)[:n - 1], np.asarray(top_ids)[:n - 1]

    def text(self, token: int) -> str:
        """One token's text (special tokens included)."""
        out = self._texts.get(token)
        if out is None:
            out = self._texts[token] = (self.tokenizer.decode([token], skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False)
                                        if self.tokenizer is not None else f"token_id:{token}")
        return out

    def completion(self, prompt: list[int], answer: list[int], k: int, echo: bool) -> dict:
        """The completions ``logprobs`` object of ``answer`` (and with ``echo`` the prompt before it): tokens,
        token_logprobs, top_logprobs (the k most probable tokens and the chosen one), text_offset."""
        ids = list(prompt) + list(answer)
        chosen, top, top_ids = self.score(ids)
        first = 0 if echo else len(prompt)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for t in range(first, len(ids)):
            token = self.text(ids[t])
            out["tokens"].append(token)
            out["text_offset"].append(offset)
            offset += len(token)
            if t == 0:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            alternatives = {self.text(int(i)): float(v) for i, v in zip(top_ids[t - 1, :k], top[t - 1, :k])}
            alternatives[token] = float(chosen[t - 1])
            out["token_logprobs"].append(float(chosen[t - 1]))
            out["top_logprobs"].append(alternatives)
        return out

    def chat(self, prompt: list[int], answer: list[int], k: int) -> dict:
        """The chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs: [k of them]}]}."""
        if not answer:
            return {"content": []}
        chosen, top, top_ids = self.score(list(prompt) + list(answer))
        entry = lambda token, value: {"token": token, "logprob": value, "bytes": list(token.encode())}  # noqa
        content = []
        for i, token_id in enumerate(answer):
            at = len(prompt) + i - 1
            item = entry(self.text(token_id), float(chosen[at]))
            item["top_logprobs"] = [entry(self.text(int(j)), float(v)) for j, v in zip(top_ids[at, :k], top[at, :k])]
            content.append(item)
        return {"content": content}
