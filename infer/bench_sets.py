"""The evaluation sets of the DFlash paper and DeepSpec for ``python -m infer.benchmark --dataset NAME``.

Each set is read with the ``datasets`` library (``pip install 'dflash_jax[bench]'``) from its local cache:
``datasets.load_dataset(HUB_ID, CONFIG, split=SPLIT)``, so ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` and
``HF_DATASETS_CACHE`` work as they do for any ``datasets`` user (offline: the cache only; online: a set not yet
cached is fetched into it once). ``--dataset-path DIR`` reads a local copy through the same call in place of the
hub id: a directory laid out as the set's Hugging Face repository (``hf download HUB_ID --repo-type dataset
--local-dir DIR``; its README's ``configs`` name each config's files).

A row becomes one user turn, as z-lab/dflash's benchmark builds it (the paper's code); the benchmark then applies
the target tokenizer's chat template with the assistant turn opened and ``enable_thinking=False``, as both z-lab/dflash
and DeepSpec's evaluator do (``CHAT_KWARGS``). ``--num-prompts N`` takes the split's first N rows, in order.

- ``gsm8k``: openai/gsm8k, config main, split test: ``question`` + ``REASON``
- ``math500``: HuggingFaceH4/MATH-500, split test: ``problem`` + ``REASON``
- ``humaneval``: openai/openai_humaneval, split test: ``HUMANEVAL`` around ``prompt`` (a python fence)
- ``mbpp``: google-research-datasets/mbpp, config sanitized, split test: ``prompt``
- ``mt-bench``: HuggingFaceH4/mt_bench_prompts, split train: ``prompt[0]``, the first turn (as DeepSpec's
  evaluator; z-lab/dflash also runs the second turn after the model's first answer)
- ``alpaca``: tatsu-lab/alpaca, split train: ``instruction``, then ``"\\n\\nInput:\\n" + input`` when it has one
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
CHAT_KWARGS = {"enable_thinking": False}  # the paper's runs are non-thinking; templates without the variable ignore it


class BenchSetError(ValueError):
    """A set that cannot be named, imported or read; the message (one line) says what to do."""


@dataclasses.dataclass(frozen=True)
class BenchSet:
    hub_id: str
    config: str | None
    split: str
    fields: tuple[str, ...]  # the columns ``turn`` reads
    turn: Callable[[dict], str]  # a row -> the user turn

    def load_call(self, path: str | None = None) -> str:
        """The ``datasets.load_dataset`` call that reads it, as Python source."""
        args = [repr(path or self.hub_id)] + ([repr(self.config)] if self.config else [])
        return f"datasets.load_dataset({', '.join(args)}, split={self.split!r})"


def _alpaca(row: dict) -> str:
    return f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]


SETS = {
    "gsm8k": BenchSet("openai/gsm8k", "main", "test", ("question",), lambda r: r["question"] + REASON),
    "math500": BenchSet("HuggingFaceH4/MATH-500", None, "test", ("problem",), lambda r: r["problem"] + REASON),
    "humaneval": BenchSet("openai/openai_humaneval", None, "test", ("prompt",),
                          lambda r: HUMANEVAL.format(r["prompt"])),
    "mbpp": BenchSet("google-research-datasets/mbpp", "sanitized", "test", ("prompt",), lambda r: r["prompt"]),
    "mt-bench": BenchSet("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), lambda r: r["prompt"][0]),
    "alpaca": BenchSet("tatsu-lab/alpaca", None, "train", ("instruction", "input"), _alpaca),
}


def bench_set(name: str) -> BenchSet:
    """The set called ``name``; an unknown name raises, listing the known ones."""
    if name not in SETS:
        raise BenchSetError(f"--dataset {name!r} is not one of the known sets: {', '.join(SETS)}")
    return SETS[name]


def records(name: str, n: int, path: str | None = None) -> list[dict]:
    """The first ``n`` rows of set ``name`` as prompt records, one user turn each (``{"messages": [...]}``), from
    the ``datasets`` cache (or the local copy at ``path``)."""
    spec = bench_set(name)
    if path is not None and not os.path.isdir(path):
        raise BenchSetError(f"--dataset-path {path} is not a directory (a local copy of {spec.hub_id})")
    rows = _load(name, spec, path)
    missing = [f for f in spec.fields if f not in rows.column_names]
    if missing:
        raise BenchSetError(f"--dataset {name}: {path or spec.hub_id} has no column {missing[0]!r} (columns: "
                            f"{', '.join(rows.column_names)})")
    if len(rows) == 0:
        raise BenchSetError(f"--dataset {name}: the {spec.split} split of {path or spec.hub_id} is empty")
    return [{"messages": [{"role": "user", "content": spec.turn(r)}]} for r in rows.select(range(min(n, len(rows))))]


def _load(name: str, spec: BenchSet, path: str | None):
    try:
        import datasets
    except ImportError:
        raise BenchSetError("--dataset needs the datasets library: pip install 'dflash_jax[bench]'") from None
    try:
        return datasets.load_dataset(path or spec.hub_id, spec.config, split=spec.split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # missing, unreachable, bad config / split
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if path:
            raise BenchSetError(f"--dataset-path {path}: {spec.load_call(path)} failed ({reason})") from None
        raise BenchSetError(
            f"--dataset {name}: {spec.hub_id} is not in the datasets cache and could not be fetched ({reason}); fetch "
            f"it once with network access: python -c \"import datasets; {spec.load_call()}\" (or pass --dataset-path "
            "with a local copy)") from None
