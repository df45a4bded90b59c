"""The demo target's corpus, tokenizer and pretraining loop (fast: tiny model, tiny sequences)."""
import os

import jax
import numpy as np
import pytest

from dflash_jax.demo import corpus
from dflash_jax.target import init_params
from train.demo_recipe.pretrain import (EOS_TOKEN, MASK_TOKEN, TrainHParams, check_export, evaluate, export_hf,
                                 model_config, pretrain, tokenize_files, train_tokenizer,
                                 PackedBatches)


def test_listing_excludes_tests_and_is_deterministic():
    files = corpus.all_files()
    rels = [corpus.relative_path(f) for f in files]
    assert len(files) > 100 and rels == sorted(rels) and len(set(rels)) == len(rels)
    for r in rels:
        parts = r.split("/")
        assert r.endswith(".py")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}, r
    corpus._listing.cache_clear()
    assert corpus.all_files() == files


def test_heldout_and_train_are_disjoint_and_fixed():
    train, held = corpus.train_files(), corpus.heldout_files()
    assert train and held and not set(train) & set(held)
    assert sorted(train + held) == sorted(corpus.all_files())
    assert all(corpus.is_heldout(corpus.relative_path(f)) for f in held)
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.10


def test_prompts_are_deterministic_for_a_seed():
    held = corpus.heldout_files()
    a = corpus.code_prompts(held, 6, seed=3, min_chars=150, max_chars=400, with_source=True)
    assert a == corpus.code_prompts(held, 6, seed=3, min_chars=150, max_chars=400, with_source=True)
    assert [p for p, _, _ in a] != corpus.code_prompts(held, 6, seed=4, min_chars=150, max_chars=400)
    root = corpus.stdlib_dir()
    for text, rel, line in a:
        assert len(text) >= 150 and text.endswith("\n")
        assert text.lstrip().startswith(("def ", "async def ", "class ", "@"))
        source = corpus.read_text(os.path.join(root, rel))
        assert source.splitlines(keepends=True)[line - 1] == text.splitlines(keepends=True)[0]
        assert text in source or text[:-1] == source[source.index(text[:-1]):]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    small = [f for f in corpus.train_files() if 3000 < os.path.getsize(f) < 12000][:12]
    texts = [corpus.read_text(f) for f in small]
    tok_dir = train_tokenizer(texts, str(tmp / "tok"), vocab_size=320)
    train = tokenize_files(tok_dir, texts)
    held = tokenize_files(tok_dir, [corpus.read_text(corpus.heldout_files()[0])[:4000]])
    return tmp, tok_dir, texts, train, held


def test_tokenizer_round_trips_and_has_special_tokens(tiny_data):
    from transformers import AutoTokenizer

    _, tok_dir, texts, train, _ = tiny_data
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.mask_token == MASK_TOKEN and tok.mask_token_id == 1 and len(tok) == 320
    for text in texts[:3] + ["\tx  =  1\r\n\n    \u00e9\u4e2d  # \U0001f600\n"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert train.dtype == np.uint16 and (train == 0).sum() == len(texts)


def test_tiny_pretraining_lowers_loss_resumes_exactly_and_exports(tiny_data):
    import dflash_jax as dj
    from transformers import AutoTokenizer

    tmp, tok_dir, _, train, held = tiny_data
    cfg = model_config(320, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                       max_position_embeddings=64)
    hp = TrainHParams(seq_len=32, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=4, eval_windows=4,
                      log_every=2)
    batches = PackedBatches(train, hp.seq_len, hp.batch_size, hp.seed)
    assert np.array_equal(batches.batch(5), PackedBatches(train, 32, 4, 0).batch(5))
    seen = np.concatenate([batches.batch(s) for s in range(8)])
    before = evaluate(cfg, init_params(cfg, hp.seed), seen, hp.batch_size)

    params, summary = pretrain(cfg, train, held, str(tmp / "a"), hp=hp, steps=8, progress=False, log=lambda s: None)
    assert summary["finished"] and summary["step"] == 8 and summary["heldout_loss"] is not None
    after = evaluate(cfg, params, seen, hp.batch_size)
    assert after < before - 0.3, (before, after)

    # interrupted after 5 steps, then resumed: bit-identical to the uninterrupted run
    _, s1 = pretrain(cfg, train, held, str(tmp / "b"), hp=hp, steps=8, progress=False, log=lambda s: None,
                     interrupt_at=5)
    assert s1["stopped"] and s1["step"] == 5
    resumed, s2 = pretrain(cfg, train, held, str(tmp / "b"), hp=hp, steps=8, progress=False, log=lambda s: None)
    assert s2["step"] == 8
    for x, y in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # a finished run returns at once for the same budget and continues for a larger one
    same, s3 = pretrain(cfg, train, held, str(tmp / "b"), hp=hp, steps=8, progress=False, log=lambda s: None)
    assert s3["step"] == 8 and np.array_equal(np.asarray(jax.tree_util.tree_leaves(same)[0]),
                                             np.asarray(jax.tree_util.tree_leaves(resumed)[0]))
    _, s4 = pretrain(cfg, train, held, str(tmp / "b"), hp=hp, steps=10, progress=False, log=lambda s: None)
    assert s4["step"] == 10 and s4["finished"]

    out = export_hf(cfg, params, str(tmp / "out"), tok_dir, {"heldout_loss": summary["heldout_loss"]})
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    text = "def f(x):\n    return x + 1\n" * 4
    check = check_export(out, text, max_tokens=20, compare_torch=False)  # AutoTokenizer + dj.load_target
    assert check["roundtrip"] and check["eos_token_id"] == cfg.eos_token_id[0] and check["mask_token_id"] == 1
    target = dj.load_target(out)
    assert target.config == cfg
    tok = AutoTokenizer.from_pretrained(out)
    ids = np.asarray(tok(text)["input_ids"][:20], np.int32)[None]
    ref = np.asarray(dj.target_logits(dj.Target(cfg, params), ids))
    # the export holds bf16 weights (each within 2^-9 relative of the float32 one); to first order every weight
    # matmul on the logits' path (embedding, v -> o and gate / up -> down per layer, lm_head) adds at most that
    # relative to the scale: (4 layers + 2) x 2^-9 x max|ref| (measured 0.14 of it; a real bug moves the scale)
    bound = (4 * cfg.num_hidden_layers + 2) * 2.0 ** -9 * np.abs(ref).max()
    assert np.abs(dj.target_logits(target, ids) - ref).max() <= bound


def test_demo_draft_bad_init_draft_fails_before_any_work(tmp_path, capsys):
    from train.demo_recipe.__main__ import main

    assert main(["draft", "--init-draft", str(tmp_path / "none"), "--work", str(tmp_path / "w")]) == 2
    assert "--init-draft" in capsys.readouterr().err
    assert not (tmp_path / "w" / "draft" / "data").exists()  # no data generated for a run that cannot start


@pytest.mark.parametrize("stage", ["target", "draft"])
def test_demo_stages_do_not_overwrite_the_shipped_pair(stage, tmp_path, capsys):
    """The default export goes to the work directory; --out naming the shipped pair needs --replace-shipped,
    refused before any work."""
    from dflash_jax.demo import DEMO_DRAFT, DEMO_TARGET
    from train.demo_recipe.__main__ import _out_dir, build_parser, main

    args = build_parser().parse_args([stage, "--work", str(tmp_path / "w")])
    assert _out_dir(args, stage) == str(tmp_path / "w" / stage / "export")
    for shipped in (DEMO_TARGET, DEMO_DRAFT):
        assert main([stage, "--out", shipped, "--work", str(tmp_path / "w")]) == 2
        assert "--replace-shipped" in capsys.readouterr().err
        assert not (tmp_path / "w").exists()  # nothing ran
        ok = build_parser().parse_args([stage, "--out", shipped, "--replace-shipped"])
        assert _out_dir(ok, stage) == shipped


def test_demo_draft_refuses_another_drafts_export_before_any_work(tmp_path, capsys):
    """--out holding another run's draft export (here a copy of the shipped one): refused before data or training."""
    import shutil

    from dflash_jax.demo import DEMO_DRAFT
    from train.demo_recipe.__main__ import main

    shutil.copytree(DEMO_DRAFT, tmp_path / "out")
    assert main(["draft", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]) == 2
    assert "holds the export of another draft" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_demo_draft_prompt_chars_option(capsys):
    from train.demo_recipe.__main__ import build_parser

    assert build_parser().parse_args(["draft", "--prompt-chars", "200,600"]).prompt_chars == (200, 600)
    assert build_parser().parse_args(["draft"]).prompt_chars == (120, 400)
    for bad in ("600,200", "0,10", "abc", "1,2,3"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["draft", "--prompt-chars", bad])
        assert "--prompt-chars" in capsys.readouterr().err
