"""The one prompt rule (``dflash_jax/prompts.py``): serving and training encode a prompt to the same ids.

On a tokenizer whose post-processor prepends a BOS (as LLaMA's does), ``infer.generate``,
``infer.benchmark``, ``train.make_data`` and the trainer's evaluation prompts must all give the BOS
exactly once, for text and for a chat template that writes its own BOS.
"""
from __future__ import annotations

import json
import os
import types

import pytest

from dflash_jax.checkpoints import load_tokenizer
from dflash_jax.prompts import PromptError, read_prompts
from train.data import DataError, read_shard, shard_name

WORDS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"] + [f"w{i}" for i in range(20)]
ID = {w: i for i, w in enumerate(WORDS)}
BOS = ID["<s>"]
PROMPT = "w3 w1 w4"
RESPONSE = "w5 w9"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A word-level tokenizer that adds ``<s>`` to every text, with a chat template that writes its own
    ``bos_token``; saved and loaded back the way the CLIs load a target's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    d = str(tmp_path_factory.mktemp("bos_tok"))
    fast.save_pretrained(d)
    return d


def _expected(chat: bool) -> list[int]:
    words = [ID[w] for w in PROMPT.split()]
    return [BOS, ID["<|user|>"], *words, ID["<|end|>"], ID["<|assistant|>"]] if chat else [BOS, *words]


def _make_data_prompt(tok, pfile: str, out: str, chat: bool) -> list[int]:
    """The prompt part (loss mask 0) of make_data's one sequence, from ready responses (no model runs)."""
    from train.make_data import make_data

    target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(WORDS), eos_token_id=(ID["</s>"],)),
                                   path=out)
    make_data(target, pfile, out, responses="use", chat=chat, tokenizer=tok, progress=False, log=lambda *a: None)
    [(ids, mask)] = read_shard(os.path.join(out, shard_name(0)))
    return ids[mask == 0].tolist()


@pytest.mark.parametrize("chat", [False, True])
def test_generate_benchmark_make_data_and_eval_encode_a_prompt_alike(tok_dir, tmp_path, chat):
    from infer import benchmark, generate
    from infer.prompt_input import encode
    from train.evaluate import load_eval_prompts

    tok = load_tokenizer(tok_dir)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": PROMPT, "response": RESPONSE}) + "\n")
    text = tmp_path / "p.txt"
    text.write_text(PROMPT + "\n")
    chat_flag = ["--chat"] if chat else []
    got = {
        "generate --prompt": generate.prompt_ids(generate.parse_args(["--prompt", PROMPT] + chat_flag), tok),
        "generate --prompts-file": generate.prompt_ids(
            generate.parse_args(["--prompts-file", str(text)] + chat_flag), tok),
        "make_data": [_make_data_prompt(tok, str(jsonl), str(tmp_path / "data"), chat)],
        "eval prompts": load_eval_prompts(str(text), tok, 8, chat),
    }
    if not chat:  # the benchmark has no --chat
        got["benchmark"] = encode(tok, benchmark.prompt_records(
            benchmark.parse_args(["--target", tok_dir, "--prompts-file", str(jsonl)])))
    want = _expected(chat)
    assert got == {k: [want] for k in got}
    assert want.count(BOS) == 1


def test_text_lines_and_jsonl(tmp_path):
    """Text lines: ``\\n`` is a newline, blank lines at the end ignored; JSONL: text or ids, responses kept; the
    file kind is the file's."""
    f = tmp_path / "p.txt"
    f.write_text("a\\nb\n  {not json}\n\n \n")
    assert read_prompts(str(f)) == [{"prompt": "a\nb"}, {"prompt": "  {not json}"}]
    j = tmp_path / "p.jsonl"
    j.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + json.dumps({"prompt": "x\\ny", "response": "r"}) + "\n")
    assert read_prompts(str(j)) == [{"prompt_ids": [1, 2]}, {"prompt": "x\\ny", "response": "r"}]


@pytest.mark.parametrize("content,match", [
    ('{"prompt": 3}\n', "prompt must be a string"),
    ('{"prompt_ids": [1, "2"]}\n', "prompt_ids must be a list of integers"),
    ('{"text": "x"}\n', '"prompt", "prompt_ids" or "messages"'),
    ('{"prompt": "a"}\n{"prompt": \n', "line 2 is not valid JSON"),
    ("\n  \n", "is empty"),
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n', "line 2 is blank"),  # dropped, it would shift b's index
    ("a\n \nb\n", "line 2 is blank"),
    (b"caf\xe9\n", r"is not UTF-8 text \(invalid continuation byte at byte 3\)"),
])
def test_bad_prompt_files_raise_prompt_error(tmp_path, content, match):
    f = tmp_path / ("p.jsonl" if "{" in str(content) else "p.txt")
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(PromptError, match=match):
        read_prompts(str(f))
    assert issubclass(DataError, PromptError) and issubclass(PromptError, ValueError)


def test_generate_prompt_error_is_one_line_exit_2(tok_dir, tmp_path, capsys):
    from infer import generate

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": 3}\n')
    with pytest.raises(SystemExit) as e:
        generate.prompt_ids(generate.parse_args(["--prompts-file", str(f)]), load_tokenizer(tok_dir))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "prompt must be a string" in err
