"""Conversation data (``{"messages": [...]}``, ShareGPT / UltraChat style) through make_data and training:
the chat template encodes them, the target regenerates the last or every assistant turn, and only
assistant tokens are supervised."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dflash_jax.checkpoints import load_tokenizer
from dflash_jax.target import Target, init_params, save_target
from pairs import tiny_target_config
from train.data import read_shard, shard_name

WORDS = ["<pad>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"] + [f"w{i}" for i in range(26)]
ID = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def conversation(rng, turns: int) -> dict:
    msgs = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": " ".join(f"w{i}" for i in rng.randint(0, 26, rng.randint(2, 6)))})
        msgs.append({"role": "assistant", "content": " ".join(f"w{i}" for i in rng.randint(0, 26, 5))})
    return {"messages": msgs}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random target whose directory holds a word-level tokenizer with a chat template, and a
    file of two-turn conversations."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("conv")
    cfg = tiny_target_config(vocab=len(WORDS), eos_token_id=(ID["</s>"],))
    params = init_params(cfg, 0)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 30  # peaked: the draft has something to learn
    tdir = save_target(Target(cfg, params), str(root / "target"))
    tok = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tdir)
    rng = np.random.RandomState(0)
    convs = [conversation(rng, 2) for _ in range(12)]
    pfile = root / "conversations.jsonl"
    pfile.write_text("".join(json.dumps(c) + "\n" for c in convs))
    import dflash_jax as dj

    return dj.load_target(tdir), str(pfile), convs, root


def _sequences(out):
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    return [s for i in range(len(manifest["shards"])) for s in read_shard(os.path.join(out, shard_name(i)))]


def _chat(tok, msgs, gen=False):
    from dflash_jax.prompts import token_ids

    return token_ids(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))


@pytest.mark.parametrize("turns", ["last", "all"])
def test_target_regenerates_assistant_turns(setup, turns):
    from dflash_jax.decode import generate
    from train.make_data import make_data

    target, pfile, convs, root = setup
    tok = load_tokenizer(target.path)
    out = str(root / f"gen_{turns}")
    make_data(target, pfile, out, max_new_tokens=8, batch_size=4, progress=False, turns=turns, log=lambda *a: None)
    seqs = _sequences(out)
    # the prompt of each sequence: the history before the regenerated assistant turn, as given
    cuts = [(c, 3) for c in convs] if turns == "last" else [(c, i) for c in convs for i in (1, 3)]
    assert len(seqs) == len(cuts)
    prompts = [list(_chat(tok, c["messages"][:i], gen=True)) for c, i in cuts]
    answers = generate(target, prompts, max_new_tokens=8, stop_token_ids=[ID["</s>"]])
    for (ids, mask), p, a in zip(seqs, prompts, answers):
        assert ids.tolist() == a.output_ids  # prompt + the target's own answer
        assert mask.tolist() == [0] * len(p) + [1] * a.num_generated  # only the regenerated turn supervised


def test_sampled_responses_do_not_depend_on_the_batching(setup):
    """make_data streams its prompts through continuously batched slots and keys each by (seed, its index in
    the run): sampled data is the same with 2 slots and 12-prompt shards as with 5 slots and 5-prompt shards,
    and another seed gives other data."""
    from train.make_data import make_data

    target, pfile, _, root = setup
    kw = dict(max_new_tokens=6, temperature=1.0, progress=False, log=lambda *a: None)
    runs = {}
    for name, slots, shard, seed in (("a", 2, 12, 3), ("b", 5, 5, 3), ("c", 2, 12, 4)):  # c: a's programs
        make_data(target, pfile, str(root / f"sampled_{name}"), batch_size=slots, shard_size=shard, seed=seed, **kw)
        runs[name] = [ids.tolist() for ids, _ in _sequences(str(root / f"sampled_{name}"))]
    assert len(runs["a"]) == 12 and runs["a"] == runs["b"]
    assert runs["c"] != runs["a"]  # the seed is used: it sampled


def test_given_conversations_supervise_only_assistant_tokens(setup):
    from train.make_data import make_data

    target, pfile, convs, root = setup
    tok = load_tokenizer(target.path)
    out = str(root / "use")
    make_data(target, pfile, out, responses="use", progress=False, log=lambda *a: None)
    seqs = _sequences(out)
    assert len(seqs) == len(convs)
    for (ids, mask), c in zip(seqs, convs):
        assert ids.tolist() == list(_chat(tok, c["messages"]))
        supervised = [WORDS[t] for t in ids[mask == 1]]
        want = []
        for m in c["messages"]:  # each assistant turn's words and its end-of-turn token, nothing else
            if m["role"] == "assistant":
                want += m["content"].split() + ["<|end|>"]
        assert supervised == want


def test_conversation_data_trains_end_to_end(setup):
    from train.config import TrainConfig
    from train.loop import train
    from train.make_data import make_data

    target, pfile, _, root = setup
    data = str(root / "train_data")
    make_data(target, pfile, data, max_new_tokens=16, batch_size=4, turns="all", progress=False, log=lambda *a: None)
    losses = []
    cfg = TrainConfig(target=target.path, data=data, out=str(root / "run"), draft_layers=1, block_size=4,
                      num_target_features=2, num_anchors=8, seq_len=64, batch_size=4, steps=24, lr=1e-2,
                      warmup_frac=0.1, dtype="float32", save_every=24, log_every=24, progress=False,
                      eval_num_prompts=0)
    train(cfg, target=target, on_step=lambda step, m: losses.append(m["loss"]), log=lambda *a: None)
    assert len(losses) == 24 and np.isfinite(losses).all()
    assert np.mean(losses[-6:]) < np.mean(losses[:6])  # it learns from the regenerated assistant turns
