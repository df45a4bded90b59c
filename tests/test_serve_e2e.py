"""End-to-end: the tools people point at an OpenAI-compatible server, run against ``python -m infer.serve`` on the
demo pair (greedy, ``--temperature 0``), offline. Slow (a few minutes on a CPU): CI deselects ``-m "not slow"``.

- guidellm (``guidellm run``): a short synchronous profile over /v1/completions and a short concurrent profile
  in guidellm's default request format (streamed /v1/chat/completions, vLLM's ``stream_options.continuous_usage_stats``,
  ``ignore_eos``, ``max_completion_tokens``), synthetic prompts from the demo target's own tokenizer. guidellm exits
  0 even when every request fails, so its JSON report is read: every request completed, none errored or
  incomplete, each with the asked number of output tokens.
- lm-evaluation-harness (``lm_eval run --model local-completions``, token-id prompts through the demo target's
  tokenizer): a local generate_until task and a local multiple-choice (loglikelihood: ``echo``, ``logprobs``,
  ``max_tokens: 1``) task written here, one request at a time and four at once with two prompts per request.
  The harness stops on a failed request (``max_retries=1``); its answers are checked against the target itself:
  generations equal plain greedy decoding cut at the stop string, loglikelihoods equal the target's log-softmax.

After each run the server's /metrics count no request outcome but ``ok`` and no HTTP status but 200.
Install the tools with ``pip install -e ".[test,e2e]"``; run with ``python -m pytest -m slow tests/test_serve_e2e.py``.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_jax.demo import DEMO_TARGET
from serve_process import serve_cli

pytestmark = pytest.mark.slow

MODEL, SLOTS, MAX_LENGTH = "dflash-demo", 4, 512
GEN_TOKENS = 16
GEN_DOCS = [{"prompt": "def add(a, b):\n", "answer": "    return a + b"},
            {"prompt": "import os\n\n\ndef read_lines(path):\n", "answer": "    with open(path) as f:"},
            {"prompt": "class Stack:\n    def __init__(self):\n", "answer": "        self.items = []"},
            {"prompt": "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "answer": "    if n < 2:"},
            {"prompt": "for i in range(10):\n", "answer": "    print(i)"}]
MC_DOCS = [{"question": "def add(a, b):\n    return a", "choices": ["+ b", "- b", "* b"], "label": 0},
           {"question": "import os\nprint(os.path.", "choices": ["join(a, b))", "banana", "x"], "label": 0},
           {"question": "for i in", "choices": ["range(10):", "ten]", "}"], "label": 0},
           {"question": "class Stack:\n    def __init__(", "choices": ["self):", "):", "cls, x"], "label": 0},
           {"question": "if __name__ ==", "choices": ["\"__main__\":", "main", "0"], "label": 0}]
LIMIT = 4  # documents per task (--limit): the fifth is there to show --limit works


def tool_env(tmp) -> dict:
    """The tools' environment: nothing reaches the network; caches in the test's temp dir."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp / "hf_home"), HF_DATASETS_CACHE=str(tmp / "hf_datasets"),
               TOKENIZERS_PARALLELISM="false", OPENAI_API_KEY="none", NO_PROXY="127.0.0.1,localhost")
    env.pop("XLA_FLAGS", None)  # the tools load no JAX model
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m infer.serve`` on the demo pair, greedy by default -> (base URL, its log file)."""
    log = tmp_path_factory.mktemp("serve_e2e") / "server.log"
    with serve_cli(["--temperature", "0", "--max-batch", str(SLOTS), "--max-length", str(MAX_LENGTH),
                    "--log-level", "warning"], log) as (_, base):
        yield base, log


@pytest.fixture(scope="module")
def demo():
    import dflash_jax as dj
    from transformers import AutoTokenizer

    return dj.load_target(DEMO_TARGET), AutoTokenizer.from_pretrained(DEMO_TARGET)  # float32, as the server


def metrics(base) -> dict:
    """{(name, labels): value} of the server's /metrics."""
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def served(base, before) -> dict:
    """Requests answered since ``before`` by outcome: asserts none but ``ok`` and no HTTP status but 200.
    Returns {endpoint: ok requests}."""
    after = metrics(base)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    outcomes = {dict(k[1])["endpoint"] + ":" + dict(k[1])["outcome"]: v for k, v in delta.items()
                if k[0] == "dflash_requests_total" and v}
    statuses = {dict(k[1])["route"] + ":" + dict(k[1])["status"]: v for k, v in delta.items()
                if k[0] == "dflash_http_responses_total" and v and dict(k[1])["route"] != "/metrics"}
    assert all(k.endswith(":ok") for k in outcomes), outcomes
    assert all(k.endswith(":200") for k in statuses), statuses
    return {k.split(":")[0]: int(v) for k, v in outcomes.items()}


def run_tool(args, tmp, timeout=600) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=tmp, env=tool_env(tmp), capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args[:2])} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


# ------------------------------------------------------------------------------------------------------ guidellm

@pytest.mark.parametrize("profile, request_format, requests", [
    ("kind=synchronous", "/v1/completions", 4),
    ("kind=concurrent,streams=4", None, 8),  # guidellm's default format: streamed chat completions
])
def test_guidellm(server, tmp_path, profile, request_format, requests):
    pytest.importorskip("guidellm", reason="the e2e extra: pip install -e '.[test,e2e]'")
    base, _ = server
    backend = f"kind=openai_http,target={base},model={MODEL}"
    if request_format:
        backend += f",request_format={request_format}"
    report = tmp_path / "guidellm.json"
    before = metrics(base)
    run_tool(["guidellm", "run", "--backend", backend, "--profile", profile,
              "--constraint", f"kind=max_requests,count={requests}",
              "--tokenizer", f"kind=hf_auto,model={DEMO_TARGET}",
              "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={GEN_TOKENS}",
              "--output", f"kind=json,path={report}", "--disable-console"], tmp_path)
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 1
    done = benchmarks[0]["requests"]
    assert (len(done["successful"]), len(done["errored"]), len(done["incomplete"])) == (requests, 0, 0), \
        [r["info"]["error"] for r in done["errored"] + done["incomplete"]]
    for r in done["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] and body["ignore_eos"]  # streamed, budget always spent (vLLM's ignore_eos)
        assert r["output_metrics"]["text_tokens"] == GEN_TOKENS
        # the server's prompt_tokens: guidellm's 32 synthetic tokens, plus the chat template's for chat
        assert r["input_metrics"]["text_tokens"] == 32 if request_format else r["input_metrics"]["text_tokens"] > 32
        assert r["output"]
    endpoint = "completions" if request_format == "/v1/completions" else "chat"
    assert served(base, before) == {endpoint: requests}


# ------------------------------------------------------------------------------------------- lm-evaluation-harness

def write_tasks(root) -> None:
    """A generate_until task and a multiple-choice task over local jsonl files (--include_path ``root``)."""
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.yaml").write_text(f"""\
task: dflash_e2e_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (root / "mc.yaml").write_text(f"""\
task: dflash_e2e_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")


def greedy_text(demo, prompt: str, stop: str) -> str:
    """Plain greedy decoding of ``prompt`` (GEN_TOKENS, ending at EOS) as text, cut at ``stop``."""
    import dflash_jax as dj

    target, tok = demo
    ids = tok(prompt)["input_ids"]
    out = dj.generate(target, [ids], max_new_tokens=GEN_TOKENS,
                      stop_token_ids=list(target.config.eos_token_id))[0].generated_ids
    return tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False).split(stop)[0]


def loglikelihood(demo, context: str, continuation: str) -> float:
    """The target's log-probability of ``continuation`` after ``context``, tokenized as lm-eval does (the whole
    text encoded, the context's tokens split off)."""
    import dflash_jax as dj

    target, tok = demo
    assert context == context.rstrip()  # no trailing spaces for lm-eval to move
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    logits = dj.target_logits(target, np.asarray([whole], np.int32))[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return float(sum(logp[i - 1, whole[i]] for i in range(n, len(whole))))


@pytest.mark.parametrize("concurrent, batch", [(1, 1), (4, 2)])
def test_lm_eval_local_completions(server, demo, tmp_path, concurrent, batch):
    pytest.importorskip("lm_eval", reason="the e2e extra: pip install -e '.[test,e2e]'")
    pytest.importorskip("tenacity", reason="lm_eval's api extra (the e2e extra holds it)")
    base, _ = server
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    before = metrics(base)
    model_args = (f"model={MODEL},base_url={base}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={DEMO_TARGET},max_length={MAX_LENGTH},num_concurrent={concurrent},max_retries=1,"
                  f"timeout=300")
    out_dir = tmp_path / "out"
    run_tool(["lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
              "--tasks", "dflash_e2e_gen,dflash_e2e_mc", "--include_path", str(tasks), "--limit", str(LIMIT),
              "--batch_size", str(batch), "--output_path", str(out_dir), "--log_samples"], tmp_path)

    results = json.loads(open(glob.glob(str(out_dir / "*" / "results_*.json"))[0]).read())
    assert results["n-samples"] == {"dflash_e2e_gen": {"original": len(GEN_DOCS), "effective": LIMIT},
                                    "dflash_e2e_mc": {"original": len(MC_DOCS), "effective": LIMIT}}
    assert 0.0 <= results["results"]["dflash_e2e_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["results"]["dflash_e2e_mc"]["acc,none"] <= 1.0

    def samples(task):
        rows = [json.loads(line) for line in open(glob.glob(str(out_dir / "*" / f"samples_{task}_*.jsonl"))[0])]
        assert sorted(r["doc_id"] for r in rows) == list(range(LIMIT))
        return rows

    for row in samples("dflash_e2e_gen"):  # greedy generations, cut at the task's stop string
        got = row["resps"][0][0]
        assert got == greedy_text(demo, row["doc"]["prompt"], "\n\n"), row
    for row in samples("dflash_e2e_mc"):  # one loglikelihood per choice, the target's own
        assert len(row["resps"]) == len(row["doc"]["choices"])
        for args, resp in zip(row["arguments"].values(), row["resps"]):
            want = loglikelihood(demo, args["arg_0"], args["arg_1"])
            assert abs(float(resp[0][0]) - want) < 1e-3, (args, resp, want)

    counts = served(base, before)
    assert set(counts) == {"completions"}
    # one request per generation prompt and per choice, ``batch`` of them per request
    assert counts["completions"] == -(-LIMIT // batch) + -(-3 * LIMIT // batch)
