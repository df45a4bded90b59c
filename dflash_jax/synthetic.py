"""Synthetic target + draft pairs at real model shapes, for benchmarking without a download.

``PRESETS`` holds the released targets' shapes (and Qwen3-0.6B / 1.7B: real shapes a CPU runs) (written out from their ``config.json``) with their
released DFlash drafts' shapes, plus ``tiny`` (runs on a laptop CPU in seconds). ``synthetic_pair``
builds one with random weights drawn on the device, leaf by leaf, under jit (straight onto the mesh's
shardings when one is given): an 8B model never exists in host memory.

Random weights make a draft's acceptance meaningless, so benchmarks replay it instead
(``speculative_generate(..., proposer=ReplayProposer(reference, probs))``): the draft forward runs and is
paid for, but its tokens are replaced by a reference continuation (the target's own greedy output, from
plain decoding) cut at an acceptance length drawn per step and row from ``probs``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.drafts.config import DraftConfig, choose_target_layer_ids
from dflash_jax.drafts.model import Draft, draft_param_shapes
from dflash_jax.layers import device_random_params
from dflash_jax.decode.proposers import Chain, Proposal, StepView
from dflash_jax.sampling import categorical
from dflash_jax.target import Target, param_shapes


@dataclasses.dataclass(frozen=True)
class Preset:
    """A target config and the shape of its draft (layers, block size, target layer ids, mask id)."""

    target: TargetConfig
    draft_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    source: str  # where the shapes come from

    @property
    def draft(self) -> DraftConfig:
        """The draft: a Qwen3 layer stack with the target's widths and rope (as the released drafts)."""
        return DraftConfig.for_target(self.target, draft_layers=self.draft_layers, block_size=self.block_size,
                                      mask_token_id=self.mask_token_id, target_layer_ids=self.target_layer_ids)


def _qwen3(hidden, inter, layers, tie, heads=32, kv=8) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
                        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=tie, qk_norm=True,
                        rope=RopeConfig(theta=1e6), bos_token_id=151643, eos_token_id=(151645,),
                        pad_token_id=151643)


_LLAMA31_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", params=tuple(sorted(
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.items())))

# Draft shapes: 5 layers with the target's widths, block 16, target layers by the released formula
# round(1 + i*(L-4)/4) (``drafts.config.choose_target_layer_ids``; z-lab/Qwen3-{4B,8B}-DFlash-b16: layers 1, 9, 17,
# 25, 33 of 36; the paper's default of 5 draft layers; 1, 7, 13, 19, 25 of Qwen3-0.6B / 1.7B's 28). The LLaMA
# draft's ids follow the same formula (1, 8, 15, 22, 29); its mask id is LLaMA-3's first reserved special token.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(TargetConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=32768, rope=RopeConfig(theta=1e6), eos_token_id=(1,)),
                   draft_layers=2, block_size=16, target_layer_ids=choose_target_layer_ids(4, 2), mask_token_id=4095,
                   source="small CPU preset (Qwen3 layers, hidden 256, 4 layers; draft 2 layers, block 16)"),
    "qwen3-0.6b": Preset(_qwen3(1024, 3072, 28, tie=True, heads=16), 5, 16, (1, 7, 13, 19, 25), 151669,
                         "Qwen/Qwen3-0.6B config.json; draft shaped as the released Qwen3 drafts (5 layers of the "
                         "target's width, block 16, released layer formula)"),
    "qwen3-1.7b": Preset(_qwen3(2048, 6144, 28, tie=True, heads=16), 5, 16, (1, 7, 13, 19, 25), 151669,
                         "Qwen/Qwen3-1.7B config.json; draft shaped as the released Qwen3 drafts (5 layers of the "
                         "target's width, block 16, released layer formula)"),
    "qwen3-4b": Preset(_qwen3(2560, 9728, 36, tie=True), 5, 16, (1, 9, 17, 25, 33), 151669,
                       "Qwen/Qwen3-4B config.json; draft z-lab/Qwen3-4B-DFlash-b16"),
    "qwen3-8b": Preset(_qwen3(4096, 12288, 36, tie=False), 5, 16, (1, 9, 17, 25, 33), 151669,
                       "Qwen/Qwen3-8B config.json; draft z-lab/Qwen3-8B-DFlash-b16"),
    "llama3.1-8b": Preset(TargetConfig(model_type="llama", vocab_size=128256, hidden_size=4096,
                                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                       max_position_embeddings=131072, qk_norm=False, rope=_LLAMA31_ROPE,
                                       bos_token_id=128000, eos_token_id=(128001, 128008, 128009)),
                          5, 16, (1, 8, 15, 22, 29), 128002,
                          "meta-llama/Llama-3.1-8B-Instruct config.json; draft shaped as "
                          "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (5 layers, block 16, released layer formula)"),
}


def preset(name: str) -> Preset:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown synthetic preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[key]


def synthetic_pair(name: str, dtype="bfloat16", mesh=None, seed: int = 0,
                   scan_layers: bool = False) -> tuple[Target, Draft]:
    """(target, draft) of preset ``name`` with random weights in ``dtype``, on ``mesh`` (tensor-parallel per
    the sharding rules) or the default device; ``scan_layers``: the target's layers scanned (``target.scanned``)."""
    p = preset(name)
    tcfg, dcfg = dataclasses.replace(p.target, scan_layers=scan_layers), p.draft
    tsh = dsh = None
    if mesh is not None:
        from dflash_jax import model_sharding as ms

        rules = ms.model_rules(mesh, tcfg, dcfg)
        tsh, dsh = ms.param_shardings(tcfg, mesh, rules), ms.param_shardings(dcfg, mesh, rules)
    target = Target(tcfg, device_random_params(param_shapes(tcfg), seed, dtype, tsh), path=f"synthetic:{name}")
    draft = Draft(dcfg, device_random_params(draft_param_shapes(dcfg), seed + 1, dtype, dsh),
                  path=f"synthetic:{name}-draft")
    return target, draft


def num_params(shapes) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes)))


# --- the replayed acceptance-length distribution ---------------------------------------------------------


def geometric_probs(tau: float, block_size: int) -> np.ndarray:
    """P(acceptance length = 1..B) with mean ``tau``: each draft token accepted with the same probability r,
    independently, until the first rejection, cut at the block (a truncated geometric: P(L = l) =
    r^(l-1) (1 - r) for l < B, P(L = B) = r^(B-1)); r solved for the mean (bisection)."""
    if not 1 <= tau <= block_size:
        raise ValueError(f"replay tau must be in [1, block size {block_size}], got {tau}")

    def probs(r):
        p = r ** np.arange(block_size, dtype=np.float64) * (1 - r)
        p[-1] = r ** (block_size - 1)
        return p

    def mean(r):
        return float((probs(r) * np.arange(1, block_size + 1)).sum())

    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < tau else (lo, mid)
    return probs((lo + hi) / 2)


def histogram_probs(counts, block_size: int) -> np.ndarray:
    """P(acceptance length = 1..B) from counts per length (index 0 = length 1), padded to the block."""
    c = np.asarray(counts, np.float64).ravel()
    if c.size == 0 or c.size > block_size or (c < 0).any() or not c.sum() > 0:
        raise ValueError(f"the replay histogram needs 1..{block_size} non-negative counts (lengths 1..{block_size}) "
                         f"with a positive sum, got {c.tolist()}")
    return np.pad(c, (0, block_size - c.size)) / c.sum()


def read_histogram(path: str) -> list[float]:
    """Counts per acceptance length from a file: a JSON list, a JSON object with ``acceptance_histogram``
    (the benchmark's summary line), or numbers separated by spaces, commas or newlines."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        data = data.get("acceptance_histogram")
    if isinstance(data, list):
        return [float(x) for x in data]
    try:
        return [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{path}: expected counts per acceptance length (a JSON list, an object with "
                         "acceptance_histogram, or numbers separated by spaces/commas)") from None


def probs_mean(probs) -> float:
    return float((np.asarray(probs) * np.arange(1, len(probs) + 1)).sum())


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ReplayProposer(Chain):
    """The replay draft (greedy only): the real draft forward runs, then per row a length L is drawn from
    ``probs`` (P(L = 1..K), K the block size); the block's draft tokens are the row's ``reference`` (its prompt
    + the target's own greedy continuation, e.g. plain decoding's output) n+1..n+L-1, accepted, then wrong
    ones (reference + 1 mod vocab), rejected, so each step commits L tokens (fewer only where the budget
    ends the row) and the output still equals plain decoding. The real drafts stay an input (a select that
    never picks them) so the compiled loop keeps every draft matmul. Compared by identity (its arrays are
    runtime inputs; one compilation per object)."""

    reference: Sequence[Sequence[int]] = ()  # one per prompt, starting with the prompt
    probs: Any = None  # [K] probabilities of acceptance lengths 1..K

    def arrays(self, spec, rows: int, cache_len: int):
        """(reference [rows, cache_len] int32, probs [rows, K] float32), checked."""
        if not (spec.speculative and spec.greedy):
            raise ValueError("replay needs speculative greedy decoding (a draft, block size > 1, temperature 0)")
        if spec.tree_budget:
            raise ValueError("tree_budget cannot be combined with replay (a replayed step is a chain)")
        if spec.verify_lengths is not None:
            raise ValueError("verify_lengths cannot be combined with replay: a replayed step commits the length "
                             "it drew, which a shorter verify would cut")
        probs = np.asarray(self.probs, np.float64).ravel()
        if probs.shape != (spec.block_size,) or (probs < 0).any() or not abs(probs.sum() - 1) < 1e-6:
            raise ValueError(f"replay probs must be {spec.block_size} probabilities (acceptance lengths 1.."
                             f"{spec.block_size}) summing to 1, got {probs.tolist()}")
        if len(self.reference) < rows:
            raise ValueError(f"replay has {len(self.reference)} reference rows for {rows} prompts")
        return self._rows(range(rows), cache_len), np.broadcast_to(probs.astype(np.float32), (rows, spec.block_size)).copy()

    def _rows(self, streams, cache_len: int) -> np.ndarray:
        """[len(streams), cache_len] int32: the reference of each request stream."""
        ref = np.zeros((len(streams), cache_len), np.int32)
        for i, stream in enumerate(streams):
            r = np.asarray(self.reference[stream], np.int32)[:cache_len]
            ref[i, :len(r)] = r
        return ref

    def admitted(self, spec, args, rows, streams):
        """Continuous batching: slot ``rows`` replay the references of request ``streams`` (a ``Request``'s
        ``stream``: request i of ``continuous_generate`` is stream i, as row i of a batch is)."""
        if max(streams) >= len(self.reference):
            raise ValueError(f"replay has {len(self.reference)} reference rows; request stream {max(streams)}")
        reference, probs = args
        host = np.array(jax.device_get(reference))
        host[list(rows)] = self._rows(streams, host.shape[1])
        return (host if isinstance(reference, np.ndarray) else jax.device_put(host, reference.sharding)), probs

    def propose(self, spec, view: StepView) -> Proposal:
        real = super().propose(spec, view)
        reference, probs = view.args
        b, k1 = real.tokens.shape
        length = categorical(view.key, jnp.log(probs)) + 1
        pos = view.lengths[:, None] + 1 + jnp.arange(k1)
        ref = jnp.take_along_axis(reference, jnp.minimum(pos, reference.shape[1] - 1), axis=1)
        out = jnp.where(jnp.arange(k1)[None] < length[:, None] - 1, ref, (ref + 1) % spec.target_config.vocab_size)
        return Proposal(jnp.where(real.tokens < 0, real.tokens, out), real.scores)
