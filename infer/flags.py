"""The command-line options the ``infer`` CLIs share, and what they resolve to: decoding options, stop ids, the
block choice, paging and row counts; ``die`` / ``exits_on_interrupt``: how a CLI ends."""
from __future__ import annotations

import argparse
import functools
import sys

from dflash_jax.attention import DECODE_IMPLS
from dflash_jax.cli_flags import add_dtype_arg
from infer.auto_block import PROBE_ROWS


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="Hugging Face target of a supported model_type (docs/models.md): "
                                    "directory or hub id (default: embedded demo)")
    g.add_argument("--draft", help="DFlash draft: directory or hub id (default: embedded demo draft when the "
                                   "target is the demo; none otherwise = plain decoding)")
    add_dtype_arg(g)
    g.add_argument("--mesh", default=None,
                   help="shard over devices: 'data=2,tensor=4' (axes data, fsdp, expert, tensor; omitted = 1, one "
                        "may be -1 = the rest) or 'auto' (all devices on data). Params tensor-parallel (MoE experts "
                        "over expert), prompts and caches data-parallel. Multi-host: set DFLASH_DISTRIBUTED=1 (TPU "
                        "pods) or JAX_COORDINATOR_ADDRESS. Default: one device")
    g.add_argument("--scan-layers", action="store_true",
                   help="compile the target's repeating layers as one scan (runs of one kind, or a repeating "
                        "pattern): each program compiles one body per group of layers, not one per layer, so a deep "
                        "target starts faster (docs/scanned-layers.md); outputs unchanged. Default: unrolled")
    d = p.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    d.add_argument("--max-length", type=int, default=None,
                   help="cap on prompt + generated tokens per row (default: target max_position_embeddings)")
    d.add_argument("--block-size", type=block_size_arg, default="auto",
                   help="draft block (tokens verified per step): auto (default): the block of the most expected "
                        f"tokens per second on this device, from short probe runs of up to {PROBE_ROWS} of the run's "
                        "prompts (evenly spread) at each of 4, 8, ..., the trained block (step costs and acceptance), "
                        "before the timed run (docs/block-size.md); the trained block unprobed for runs under 48 new "
                        "tokens and with --tree-budget / --verify-lengths. Or an integer in [1, the draft's trained "
                        "block]: no probe. A DSpark draft's block is its input slots: B slots draft B tokens, B + 1 "
                        "verified")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    d.add_argument("--top-k", type=int, default=0, help="0 = off")
    d.add_argument("--acceptance", default="rejection", choices=["match", "rejection"],
                   help="at temperature > 0: rejection (default; speculative sampling: drafts sampled from the "
                        "draft, accepted with probability min(1, p/q); longer acceptance on the demo pair) or "
                        "match (the reference rule: a greedy draft token accepted while it equals the target's "
                        "sample); both keep the target's distribution")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    d.add_argument("--verify-lengths", default=None,
                   help="adaptive verify: comma-separated lengths, e.g. 4,8,16; each step the target verifies only "
                        "the first L block tokens, L the longest of these the draft's confidence justifies at "
                        "--verify-threshold (lossless at any setting). Default: the whole block every step")
    d.add_argument("--verify-threshold", type=float, default=0.1,
                   help="with --verify-lengths: a longer verify is taken while the draft expects at least this "
                        "many accepted tokens per added position (0: always the longest; > 1: the shortest; "
                        "default 0.1, the best measured on the demo pair: docs/adaptive-verify.md)")
    d.add_argument("--tree-budget", type=int, default=0,
                   help="tree verification: each step the target verifies a tree of the N most probable draft "
                        "prefixes (plus the pending token: N + 1 tokens) and keeps its longest matching path; "
                        "lossless. 0 (default): the chain (the block)")
    d.add_argument("--confidence-threshold", type=float, default=0.0,
                   help="DSpark drafts with a confidence head: each step's proposal stops before its first slot "
                        "whose predicted acceptance is below this, in [0, 1) (lossless at any setting). 0 (default): "
                        "off, every slot proposed, as DeepSpec's evaluation")
    d.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; greedy ignores it)")
    d.add_argument("--stop-token-ids", default=None,
                   help="comma-separated stop ids (default: the target's eos_token_id)")
    d.add_argument("--ignore-eos", action="store_true", help="no stop tokens: always generate max-new-tokens")
    d.add_argument("--attention", default="auto", choices=DECODE_IMPLS,
                   help="decode attention: auto (default; reads only each row's length: the Pallas kernel on one "
                        "TPU / GPU, a tiled loop elsewhere), kernel, interpret, loop, or reference (dense over the "
                        "whole cache, the unbounded path, for comparison)")


def block_size_arg(text: str):
    """``--block-size``: "auto" or an integer."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def fixed_block_size(args) -> int | None:
    """The ``--block-size`` integer, or None for auto (and for a parser without the option)."""
    b = getattr(args, "block_size", None)
    return None if b == "auto" else b


def block_policy(args, draft, run_tokens: int | None = None) -> str | None:
    """The engine's ``block_policy``: "auto" (each bucket of live rows verifies the block of the most expected tokens
    per second) for ``--block-size auto`` with a draft's chain (no tree, no adaptive verify) and, for a run of
    ``run_tokens`` new tokens per row, one long enough to pay for the probes; None: a fixed block."""
    from infer.auto_block import worth_probing

    if draft is None or args.block_size != "auto" or args.tree_budget or args.verify_lengths is not None:
        return None
    if run_tokens is not None and not worth_probing(draft.config.block_size, run_tokens):
        return None
    return "auto"


def resolve_block(args, target, draft, prompts, kw: dict):
    """(block to decode with, ``auto_block.Choice`` or None): ``--block-size`` as given, else auto's choice on
    ``prompts`` (said on stderr); None = the draft's trained block (no draft, tree or adaptive verify, a run
    too short to probe)."""
    if args.block_size != "auto":
        return args.block_size, None
    from infer.auto_block import choose_block_size

    if block_policy(args, draft, args.max_new_tokens) is None:  # the same cases the engine's policy leaves out
        return None, None
    if args.confidence_threshold:  # the probes decode as the run will: with its confidence cut
        kw = dict(kw, confidence_threshold=args.confidence_threshold)
    try:
        choice = choose_block_size(target, draft, prompts, kw)
    except ValueError as e:
        die(str(e))
    print(choice.describe(), file=sys.stderr)
    return choice.block_size, choice


def decoding_kwargs(args, target) -> dict:
    """The decoding options of ``speculative_generate`` / ``generate`` that the command line sets."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, acceptance=args.acceptance, stop_token_ids=stop_ids(args, target), seed=args.seed,
                max_length=args.max_length, attention_impl=args.attention)


def adaptive_kwargs(args) -> dict:
    """``verify_lengths`` / ``verify_threshold`` from the options (empty when every step verifies the block)."""
    if args.verify_lengths is None:
        return {}
    try:
        lengths = [int(x) for x in args.verify_lengths.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths:
        die(f"--verify-lengths takes comma-separated integers, got {args.verify_lengths!r}")
    return dict(verify_lengths=lengths, verify_threshold=args.verify_threshold)


def draft_kwargs(args) -> dict:
    """The options only a speculative run takes (``tree_budget``, ``confidence_threshold``), those that are set."""
    out = dict(tree_budget=args.tree_budget, confidence_threshold=args.confidence_threshold)
    return {k: v for k, v in out.items() if v}


def shows_bar(args) -> bool:
    """A command's progress bar shows on stderr in text mode, and with ``--json`` (the rows on stdout) only where
    stderr is a terminal, so that a log file never fills with bar redraws."""
    return not args.json or sys.stderr.isatty()


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def exits_on_interrupt(main):
    """A CLI's ``main`` that answers Ctrl-C with one line, "interrupted", and exit code 130 (128 + SIGINT), not a
    traceback from wherever the decode loop was."""
    @functools.wraps(main)
    def run(argv=None) -> int:
        try:
            return main(argv)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    return run


# The options' names in the shared checks' messages (``dflash_jax.decode.options.option_names``).
FLAGS = {"max_new_tokens": "--max-new-tokens", "seed": "--seed", "block_size": "--block-size",
         "draft": "a draft (--draft)", "attention_impl": "--attention", "verify_lengths": "--verify-lengths",
         "verify_threshold": "--verify-threshold", "tree_budget": "--tree-budget",
         "confidence_threshold": "--confidence-threshold", "max_length": "--max-length"}


def stop_ids(args, target) -> list[int]:
    """The stop ids the options ask for (``target``: a Target or its config)."""
    if args.ignore_eos:
        return []
    if args.stop_token_ids:
        try:
            return [int(x) for x in args.stop_token_ids.split(",") if x.strip()]
        except ValueError:
            die(f"--stop-token-ids {args.stop_token_ids!r}: expected comma-separated integers")
    return list(getattr(target, "config", target).eos_token_id)


def parse_ints(text: str, flag: str) -> list[int]:
    """Positive integers from a comma-separated option value (``--batch-size 1,8``); dies naming ``flag``."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        die(f"{flag} takes positive integers separated by commas, got {text!r}")
    return out


DEFAULT_MAX_BATCH = 16


_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def memory_arg(text: str) -> tuple[str, float]:
    """``--kv-cache-memory``: bytes with an optional unit (2GiB, 512MB, 3e9) -> ("bytes", n); a plain number in
    (0, 1] -> ("fraction", f) of the device's free memory after the weights."""
    t = text.strip().lower()
    unit = next(u for u in sorted(_UNITS, key=len, reverse=True) if t.endswith(u))
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (2GiB, 512MB, 3e9) or a fraction (0.9), got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return ("fraction", value) if unit == "" and value <= 1 else ("bytes", value * _UNITS[unit])


def add_max_batch_arg(g) -> None:
    from dflash_jax.decode.slots import CPU_PAGE, PAGE

    g.add_argument("--max-batch", type=int, default=None,
                   help="the most rows in flight: the prompts stream through N rows, continuously batched (a row "
                        f"that finishes takes the next prompt at once); default: {DEFAULT_MAX_BATCH}, or fewer where "
                        "their caches at the max length would pass a quarter of the accelerator's free memory, and "
                        "never more than the prompts")
    g.add_argument("--kv-cache-memory", type=memory_arg, default=None,
                   help="memory of the paged K/V cache pool (the target's and the draft's): bytes (2GiB, 512MB, 3e9) "
                        "or a fraction of the device's free memory after the weights (0.9); rows take pages as "
                        "they grow, and when the pool runs dry the newest row is preempted and resumed later, its "
                        "output unchanged. Default: every row of --max-batch at the max length (never dry)")
    g.add_argument("--page-size", type=int, default=None,
                   help=f"tokens per cache page (default {CPU_PAGE} on CPU, {PAGE} on TPU / GPU; 0: every row owns a "
                        "cache of the max length)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole: no sharing of the pages of prompt prefixes already cached (on "
                        "by default where pages hold every layer; hybrid and sliding-window targets never share)")


def check_page_size(args) -> None:
    """Dies on a ``--page-size`` below 0 (a CLI that loads its models later calls it first)."""
    page = getattr(args, "page_size", None)
    if page is not None and page < 0:
        die(f"--page-size must be >= 0, got {page}")


def paging_kwargs(args) -> dict:
    """``Engine``'s ``page`` and ``kv_cache_memory`` from the flags (a fraction resolved against the device's free
    memory now, after the weights loaded); dies on a bad value."""
    from dflash_jax.decode.memory import free_device_bytes

    check_page_size(args)
    out = dict(page=getattr(args, "page_size", None), prefix_cache=not getattr(args, "no_prefix_cache", False))
    if args.kv_cache_memory is None:
        return out
    kind, value = args.kv_cache_memory
    if kind == "bytes":
        return dict(out, kv_cache_memory=int(value))
    free = free_device_bytes()
    if free is None:
        die("--kv-cache-memory as a fraction needs a device that reports its memory (TPU, GPU); on this one give "
            "bytes (for example 2GiB)")
    return dict(out, kv_cache_memory=int(free * value))


def max_batch(args, target, draft, prompts, overrides, kw: dict) -> int:
    """``--max-batch``, or the default: ``DEFAULT_MAX_BATCH`` rows, fewer where their caches would pass a quarter
    of the device's free memory (``slots_that_fit``), never more than the prompts."""
    if args.max_batch is not None:
        return args.max_batch
    from dflash_jax.decode import DecodeOptions, cache_length
    from dflash_jax.decode.memory import slots_that_fit

    budget = [own.get("max_new_tokens", kw["max_new_tokens"]) for own in overrides]
    max_block = DecodeOptions(**kw).max_block(draft)
    cache_len = cache_length([len(p) for p in prompts], budget, max_block)
    return slots_that_fit(target, draft, cache_len, min(DEFAULT_MAX_BATCH, len(prompts)), max_block)
