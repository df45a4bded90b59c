"""Tiny target + draft pairs for engine tests (random weights; no network)."""
from __future__ import annotations

import contextlib
import dataclasses

from dflash_jax.config import TargetConfig
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.model import Draft, init_draft_params
from dflash_jax.target import Target, init_params


def tiny_target_config(vocab: int = 96, layers: int = 4, **kw) -> TargetConfig:
    base = dict(model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                eos_token_id=(1,))
    return TargetConfig(**{**base, **kw})


def random_draft(tcfg, block_size: int = 16, seed: int = 1, draft_layers: int = 2,
                 target_layer_ids=(0, 2, 3)) -> Draft:
    """A random draft for a target of any family, shaped as ``python -m train`` makes them."""
    dcfg = DraftConfig.for_target(tcfg, draft_layers=draft_layers, block_size=block_size,
                                  mask_token_id=tcfg.vocab_size - 1, target_layer_ids=target_layer_ids)
    return Draft(dcfg, init_draft_params(dcfg, seed))


def random_pair(vocab: int = 96, block_size: int = 16, seed: int = 0, draft_layers: int = 2,
                target_layer_ids=(0, 2, 3), **target_kw) -> tuple[Target, Draft]:
    tcfg = tiny_target_config(vocab, **target_kw)
    return Target(tcfg, init_params(tcfg, seed)), random_draft(tcfg, block_size, seed + 1, draft_layers,
                                                               target_layer_ids)


def trained_pair(root, vocab: int = 64, block_size: int = 16, steps: int = 60, seed: int = 0, tcfg=None):
    """A tiny random target (``tcfg``, default a Qwen3 one of ``vocab`` tokens) with a peaked head and a draft
    trained for ``steps`` steps on the target's own greedy continuations of random prompts (the project's
    make_data + train); returns (target, draft, prompts). Partial acceptance of every length is then common."""
    import json
    import os

    import numpy as np

    from dflash_jax.layers import random_params
    from dflash_jax.target import load_target, param_shapes, save_target
    from train.config import TrainConfig
    from train.loop import train
    from train.make_data import make_data

    quiet = lambda *a, **k: None  # noqa: E731
    tcfg = tcfg or tiny_target_config(vocab, eos_token_id=(vocab - 2,))
    vocab = tcfg.vocab_size
    params = random_params(param_shapes(tcfg), seed)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 30  # peaked next-token distributions
    tdir = save_target(Target(tcfg, params), os.path.join(root, "target"))
    target = load_target(tdir)
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(2, vocab - 2, rng.randint(3, 12)).tolist() for _ in range(24)]
    pfile = os.path.join(root, "prompts.jsonl")
    with open(pfile, "w") as f:
        f.writelines(json.dumps({"prompt_ids": p}) + "\n" for p in prompts)
    data = os.path.join(root, "data")
    make_data(target, pfile, data, max_new_tokens=48, batch_size=12, shard_size=12, progress=False, log=quiet)
    cfg = TrainConfig(target=tdir, data=data, out=os.path.join(root, "run"), draft_layers=1, block_size=block_size,
                      num_target_features=3, num_anchors=32, seq_len=64, batch_size=8, steps=steps, lr=1e-2,
                      warmup_frac=0.1, dtype="float32", save_every=steps, log_every=steps, progress=False,
                      eval_num_prompts=0, mask_token_id=vocab - 1)
    draft = train(cfg, target=target, log=quiet)
    return target, draft, prompts


def pair_dirs(root: str, vocab: int = 320):
    """A tiny random Qwen3 target with a byte-level BPE tokenizer and a random block-8 draft for it, saved
    in the Hugging Face layouts under ``root`` with the project's own exporters; returns
    (target_dir, draft_dir, target)."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash_jax.drafts.model import save_draft
    from dflash_jax.target import save_target

    tdir, ddir = os.path.join(root, "target"), os.path.join(root, "draft")
    target, draft = random_pair(vocab=vocab, block_size=8, eos_token_id=(0,))
    save_target(target, tdir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|MASK|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tdir)
    save_draft(Draft(dataclasses.replace(draft.config, mask_token_id=1), draft.params), ddir, dtype="float32")
    return tdir, ddir, target


def decode_in_chunks(target, ids, cache, prefill_lengths, step, feature_layer_ids):
    """Feed ids [B, S] through ``cache``: a ragged prefill (row r: its first prefill_lengths[r] tokens), then
    ``step(n)`` tokens per forward (n: the shortest row's committed length), each committed whole.
    -> (logits [B, S, V], features [B, S, F]) by position, and the final cache."""
    import numpy as np

    from dflash_jax.target import forward

    seq = ids.shape[1]
    lengths = np.zeros(ids.shape[0], np.int32)
    got, got_feats = None, None
    first = max(prefill_lengths)
    pos = np.where(np.arange(first) < np.asarray(prefill_lengths)[:, None], np.arange(first), -1).astype(np.int32)
    tok = ids[:, :first]
    while True:
        logits, feats, cache = forward(target.config, target.params, tok, pos, cache,
                                       feature_layer_ids=feature_layer_ids)
        if got is None:
            got = np.full(ids.shape + logits.shape[-1:], np.nan, np.float32)
            got_feats = np.full(ids.shape + feats.shape[-1:], np.nan, np.float32)
        for r in range(ids.shape[0]):
            ok = pos[r] >= 0
            got[r, pos[r, ok]] = np.asarray(logits)[r, ok]
            got_feats[r, pos[r, ok]] = np.asarray(feats)[r, ok]
        kept = (pos >= 0).sum(1)
        cache = cache.commit(kept)
        lengths = lengths + kept
        if lengths.min() >= seq:
            return got, got_feats, cache
        pos = lengths[:, None] + np.arange(step(lengths.min()), dtype=np.int32)
        pos = np.where(pos < seq, pos, -1).astype(np.int32)
        tok = np.take_along_axis(ids, np.clip(pos, 0, seq - 1), 1)


THRESHOLDS = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 2.0)  # adaptive verify: 0 takes the longest length, > 1 the shortest


def adaptive_lossless(target, draft, prompts, want, lengths, **kw) -> dict:
    """Adaptive verify over ``lengths`` at each of ``THRESHOLDS`` gives ``want`` (output ids per prompt), and
    every length is chosen somewhere. -> {threshold: lengths chosen in that run}."""
    from dflash_jax import decode as S

    chosen = {}
    for threshold in THRESHOLDS:
        out = S.speculative_generate(target, draft, prompts, verify_lengths=lengths, verify_threshold=threshold, **kw)
        assert [r.output_ids for r in out] == want, threshold
        assert all(a <= v for r in out for a, v in zip(r.acceptance_lengths, r.verify_lengths))
        chosen[threshold] = {v for r in out for v in r.verify_lengths}
    assert set().union(*chosen.values()) == set(lengths), chosen
    return chosen


def lossless_greedy_with_partial_acceptance(model, target, blocks=(4, 8), new: int = 24, adaptive: bool = False):
    """Speculative greedy (random drafts, ``blocks``) == plain greedy == transformers' greedy ``generate``
    of the torch ``model``, on a batch of 3 ragged prompts, with and without a stop token that cuts row
    0 short, and with ``adaptive`` verify (lengths 2 and the largest block: ``adaptive_lossless``). Partial
    acceptance (1 < acceptance < block) must occur: for a hybrid target it is what exercises the recurrent
    rollback. Needs a target vocabulary of at least 15 (small, so that a random
    draft is sometimes right)."""
    from dflash_jax import decode as S
    from hf_models import torch_greedy

    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]
    free = [torch_greedy(model, p, new) for p in prompts]
    generated = free[0][len(prompts[0]):]
    stop = next(t for i, t in enumerate(generated) if i >= 3 and t not in generated[:i])  # cuts row 0 short
    expected = [torch_greedy(model, p, new, stop) for p in prompts]
    assert len(expected[0]) < len(free[0])
    partial = []
    for stops, want in (([], free), ([stop], expected)):
        plain = S.generate(target, prompts, max_new_tokens=new, stop_token_ids=stops)
        assert [r.output_ids for r in plain] == want
        for block in blocks:
            draft = random_draft(target.config, block_size=block, target_layer_ids=(0, 2, 3))
            spec = S.speculative_generate(target, draft, prompts, max_new_tokens=new, stop_token_ids=stops)
            assert [r.output_ids for r in spec] == want, block
            partial += [a for r in spec for a in r.acceptance_lengths if 1 < a < block]
            if adaptive and block == blocks[-1]:
                adaptive_lossless(target, draft, prompts, want, (2, block), max_new_tokens=new, stop_token_ids=stops)
    assert partial, "no partial acceptance: the rollback was not exercised"


def train_briefly(path, target, root, steps: int = 30, **overrides):
    """A 1-layer block-4 draft trained ``steps`` steps on ``target``'s own greedy answers to 8 random prompts
    (make_data + train, as a user would); ``overrides``: other TrainConfig fields (e.g. ``draft_arch="dspark"``);
    returns (draft, per-step losses)."""
    import json
    import os

    import numpy as np

    from train.config import TrainConfig
    from train.loop import train
    from train.make_data import make_data

    quiet = lambda *a, **k: None  # noqa: E731
    vocab = target.config.vocab_size
    rng = np.random.RandomState(0)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt_ids": rng.randint(0, vocab, rng.randint(3, 8)).tolist()}) + "\n"
                     for _ in range(8))
    data = os.path.join(root, "data")
    make_data(target, prompts, data, max_new_tokens=24, batch_size=8, shard_size=8, progress=False, log=quiet)
    losses = []
    cfg = TrainConfig(target=path, data=data, out=os.path.join(root, "run"), draft_layers=1, block_size=4,
                      num_target_features=2, num_anchors=8, seq_len=32, batch_size=4, steps=steps, lr=1e-2,
                      warmup_frac=0.1, dtype="float32", save_every=steps, log_every=steps, progress=False,
                      eval_num_prompts=0, mask_token_id=vocab - 1, **overrides)
    draft = train(cfg, target=target, on_step=lambda s, m: losses.append(m["loss"]), log=quiet)
    return draft, losses


class CharTokenizer:
    """A tokenizer of one character per id (``chars``: id i is chars[i]) and special ids after them (``eos`` the
    first), in the form llguidance's TokenizerWrapper reads: what structured-output tests need without a download."""

    def __init__(self, chars: str, vocab: int, eos: int):
        self.chars, self.eos_token_id, self.bos_token_id = chars, eos, None
        self.special_token_ids = list(range(len(chars), vocab))
        self.tokens = [c.encode() for c in chars] + [b"\xff<special_%d>" % i for i in range(len(chars), vocab)]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        return [self.chars.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


def tight_pool(target, draft, requests, max_batch: int) -> int:
    """kv_cache_memory of a pool of one longest row and a page more: ``requests`` then preempt rows."""
    from dflash_jax.decode import DecodeOptions, Engine

    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    probe = Engine(target, draft, DecodeOptions(max_new_tokens=max(r.max_new_tokens for r in requests),
                                                stop_token_ids=()), max_batch=max_batch, max_length=longest,
                   sampled=True)
    return (probe.pool.pages_for(longest - 1 + probe.spec.max_block) + 1) * probe.page_bytes


class Alternate:
    """A block policy alternating plain steps of a draft's engine (block 1: the draft's context still written) and
    block 4 at every run (``Engine(block_policy=...)``)."""

    calls = 0

    def choose(self, bucket):
        self.calls += 1
        return 1 + 3 * (self.calls % 2)

    def observe(self, results):
        pass


@contextlib.contextmanager
def backend_compiles():
    """A list that fills with the programs the block had to build (jax.monitoring events): XLA backend compiles and
    loads from the session's persistent compilation cache (``conftest.py``: a program another module compiled loads
    from disk instead of compiling, and a warmed engine must not need it either). What a warmed engine leaves empty."""
    import jax

    compiles = []
    timed = lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else 0  # noqa
    loaded = lambda name, **kw: compiles.append(name) if name == "/jax/compilation_cache/cache_hits" else 0  # noqa
    jax.monitoring.register_event_duration_secs_listener(timed)
    jax.monitoring.register_event_listener(loaded)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(timed)
        jax.monitoring.unregister_event_listener(loaded)


def scanned_decodes_the_same(target, prompts, block: int = 4, new: int = 12, target_layer_ids=None):
    """The target with its layers scanned (``target.scanned``) against itself unrolled: a forward's logits and every
    layer's output within rounding of another program (``tolerances.forward_depth``), and the unrolled target's
    plain greedy tokens decoded by the scanned one speculatively (a random draft of ``block``), in the closed batch
    and the paged engine. Some layers must actually scan."""
    import numpy as np

    from dflash_jax import decode as S
    from dflash_jax import target as T
    from tolerances import assert_close, forward_depth

    scanned = T.scanned(target)
    assert any(repeats > 1 for _, repeats, _ in T.layer_groups(scanned.config))
    n = target.config.num_hidden_layers
    ids = np.asarray([prompts[0]], np.int32)
    pos = np.arange(ids.shape[1], dtype=np.int32)[None]
    layers = tuple(range(-1, n))
    (want_logits, want_feats, _), (logits, feats, _) = (
        T.forward(m.config, m.params, ids, pos, None, layers) for m in (target, scanned))
    depth = forward_depth(target.config, ids.shape[1])  # the same sums, in another program's order
    assert_close(logits, want_logits, depth, what="scanned logits")
    assert_close(feats, want_feats, depth, what="scanned layer outputs")
    draft = random_draft(target.config, block_size=block, target_layer_ids=target_layer_ids or (0, n // 2, n - 1))
    want = [r.output_ids for r in S.generate(target, prompts, max_new_tokens=new, stop_token_ids=[])]
    got = S.speculative_generate(scanned, draft, prompts, max_new_tokens=new, stop_token_ids=[])
    assert [r.output_ids for r in got] == want
    requests = [S.Request(p, max_new_tokens=new) for p in prompts]
    got = S.continuous_generate(scanned, draft, requests, max_batch=2, stop_token_ids=[], warm=False)
    assert [r.output_ids for r in got] == want
