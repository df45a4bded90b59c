"""Host side of every decode call: prompts checked, the ``EngineSpec`` and shared inputs built, new rows packed into
padded ``Rows`` (a closed batch pads its prompts to a multiple of 32; continuous batching to ``prompt_bucket``'s
few lengths, so a long run compiles a few prefill programs)."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from dflash_jax.drafts import model as draft_lib
from dflash_jax import sharding
from dflash_jax.decode import proposers
from dflash_jax.decode.options import DecodeOptions, check_tree_target
from dflash_jax.decode.types import EngineSpec, Inputs, Rows
from dflash_jax.target import Target, check_token_ids
from dflash_jax.sampling import RowSampling

MIN_PROMPT_BUCKET = 32


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prompt_bucket(n: int, cache_len: int) -> int:
    """Continuous batching's padded prompt length for a longest prompt of ``n`` tokens: a multiple of 32 up to
    128, then a power of two or one and a half times one (a prefill pads at most half its tokens: powers of two
    alone padded 129 to 256, and the demo pair's admissions cost 20% more prefill than a closed batch's), or the
    cache length when that is shorter."""
    n = max(int(n), 1)
    if n <= 4 * MIN_PROMPT_BUCKET:
        return min(round_up(n, MIN_PROMPT_BUCKET), cache_len)
    power = 1 << (n - 1).bit_length()
    return min(power * 3 // 4 if n <= power * 3 // 4 else power, cache_len)


def check_prompts(target: Target, prompts) -> list[np.ndarray]:
    """Prompts (lists of ids, ragged; or one flat list) -> int32 rows, each checked against the vocabulary."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]  # a single prompt given as a flat list
    vocab = target.config.vocab_size
    return [check_token_ids(np.asarray(p).reshape(1, -1) if len(p) else np.zeros((1, 0), np.int32), vocab,
                            f"prompt {i}")[0] for i, p in enumerate(prompts)]


def budgets(lens, settings: Sequence[DecodeOptions], limit: int, first: int = 0) -> np.ndarray:
    """Each row's token budget: its max_new_tokens, cut to the max length; a prompt that leaves no room raises."""
    lens = np.asarray(lens)
    too_long = [i for i, n in enumerate(lens) if n >= limit]
    if too_long:
        i = too_long[0]
        raise ValueError(f"prompt {first + i} has {lens[i]} tokens; the max length is {limit} "
                         "(prompt + generated tokens), so nothing can be generated")
    return np.minimum([s.max_new_tokens for s in settings], limit - lens).astype(np.int32)


def cache_length(prompt_lengths, budget, block_size: int, cache_len: int | None = None) -> int:
    """Cache slots per row for these prompt lengths and budgets: prompt bucket or prompt + budget, plus a
    block, rounded up to 128 (buckets bound the number of compilations); at least ``cache_len``."""
    lens, budget = np.asarray(prompt_lengths), np.asarray(budget)
    need = max(int((lens + budget).max()), round_up(int(lens.max()), MIN_PROMPT_BUCKET))
    return max(round_up(need + block_size + 1, 128), cache_len or 0)


def engine(target: Target, draft, options: DecodeOptions, cache_len: int, *, greedy: bool, rows: int,
           stop_width: int = 8, page: int = 0) -> tuple[EngineSpec, Inputs]:
    """The static spec and shared inputs of a program decoding ``rows`` rows with ``options``; every check that
    needs the models (the draft fits the target, block, verify lengths, tree target, proposer arrays)."""
    if draft is not None:
        draft_lib.check_pair(target, draft)
    block = options.block_for(draft)
    verify_lengths = options.verify_lengths_for(block)
    if options.tree_budget:
        check_tree_target(target.config, block)
    speculative = draft is not None and block > 1
    dparams = draft.params if speculative else None
    proposer = options.proposer
    if speculative and proposer is None:
        proposer = proposers.for_draft(draft.config, sampled=not greedy and options.acceptance == "rejection",
                                       confidence_threshold=options.confidence_threshold)
    spec = EngineSpec(target.config, draft.config if draft is not None else None, block, greedy,
                      sharding.mesh_of(target.params, dparams), options.acceptance, proposer if speculative else None,
                      options.attention_impl, verify_lengths, options.tree_budget, cache_len, stop_width, page,
                      logprobs=options.logprobs is not None)
    extra = spec.proposer.arrays(spec, rows, cache_len) if speculative else None
    if extra is not None and spec.mesh is not None:  # the proposer's arrays are rows first
        pad = sharding.pad_rows(rows, spec.mesh)
        extra = sharding.shard_batch(jax.tree_util.tree_map(
            lambda x: np.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)), extra), spec.mesh)
    inputs = Inputs(tparams=target.params, dparams=dparams,
                    mask_token_id=np.int32(draft.config.mask_token_id if draft is not None else 0),
                    threshold=np.float32(options.verify_threshold), proposer_args=extra)
    return spec, inputs


def stop_width(settings: Sequence[DecodeOptions]) -> int:
    """Stop ids per row: the most any row has, rounded up to 8."""
    return round_up(max([len(s.stop_token_ids) for s in settings] + [1]), 8)


@jax.jit
def _fold_streams(seeds, streams):
    """fold_in(PRNGKey-data ``seeds`` [n, 2], ``streams`` [n]) (uint32): the rows' key data [n, 2], in one program."""
    return jax.vmap(lambda k, s: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), s)))(seeds,
                                                                                                         streams)


def seed_data(seed: int) -> np.ndarray:
    """``jax.random.PRNGKey(seed)``'s data (threefry: [high 32 bits, low 32 bits]; without x64 a seed is cut to its
    low 32 bits first), computed on the host: the eager op cost a dispatch per seed at every admission."""
    high = (int(seed) >> 32) & 0xFFFFFFFF if jax.config.jax_enable_x64 else 0
    return np.array([high, int(seed) & 0xFFFFFFFF], np.uint32)


def row_keys(seeds: Sequence[int], streams: Sequence[int]) -> np.ndarray:
    """The rows' keys [n, 2]: fold_in(PRNGKey(seed), stream) (``Request``), all in one program (not two eager ops
    per row: 4000 rows took 2.1 s so). Streams are uint32: one outside [0, 2**32) is a ValueError."""
    for stream in streams:
        if not 0 <= stream < 2 ** 32:
            raise ValueError(f"a request's stream must be an integer in [0, 2**32), got {stream!r}")
    n = len(seeds)
    size = max(8, 1 << (n - 1).bit_length())  # a power of two: few programs
    data, padded = np.zeros((size, 2), np.uint32), np.zeros((size,), np.uint32)
    data[:n] = [seed_data(s) for s in seeds]
    padded[:n] = streams
    return np.asarray(_fold_streams(data, padded))[:n]


def make_rows(spec: EngineSpec, prompts: Sequence[np.ndarray], budget, settings: Sequence[DecodeOptions],
              streams: Sequence[int], *, pad_to: int | None = None, bucket: int | None = None,
              starts: Sequence[int] | None = None) -> Rows:
    """New rows as host arrays, padded to ``pad_to`` rows (1-token rows of budget 1, finished at prefill) and to a
    prompt ``bucket`` (default: the longest prompt rounded up to 32). ``starts``: each prompt's first position to
    prefill (its pages hold the rest: a cached prefix); the rows then carry the prompts from there."""
    n = len(prompts)
    pad_to = pad_to or n
    starts = np.zeros((n,), np.int32) if starts is None else np.asarray(starts, np.int32)
    tails = [r[s:] for r, s in zip(prompts, starts)]
    p = bucket or round_up(max(len(r) for r in tails), MIN_PROMPT_BUCKET)
    padded = np.zeros((pad_to, p), np.int32)
    for i, r in enumerate(tails):
        padded[i, :len(r)] = r
    lens = np.ones((pad_to,), np.int32)
    lens[:n] = [len(r) for r in prompts]
    budget = np.concatenate([np.asarray(budget, np.int32), np.ones((pad_to - n,), np.int32)])
    stops = np.full((pad_to, spec.stop_width), -1, np.int32)
    for i, s in enumerate(settings):
        stops[i, :len(s.stop_token_ids)] = s.stop_token_ids
    keys = np.zeros((pad_to, 2), np.uint32)
    keys[:n] = row_keys([s.seed for s in settings], streams)
    return Rows(prompts=padded, lens=lens, start=np.concatenate([starts, np.zeros((pad_to - n,), np.int32)]),
                budget=budget, stop_ids=stops, sampling=RowSampling.of(settings, pad_to - n), key=keys)


def place_rows(spec: EngineSpec, rows: Rows) -> Rows:
    """``rows`` on the spec's mesh (split over data*fsdp), or as they are on one device."""
    return rows if spec.mesh is None else sharding.shard_batch(rows, spec.mesh)
