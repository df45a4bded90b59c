"""Continuous batching: ``Engine`` holds S decode slots over one target (and draft); requests are admitted into free
rows while the other rows keep decoding, and released when they finish. ``continuous_generate`` streams a list of
requests through the slots.

The state is a ``DecodeState`` of S rows (every cache kind: full, sliding rings, recurrent stashes, shared KV,
latent), functional like the rest: ``admit`` / ``step`` / ``run`` / ``release`` take a state and return the next
(the old one is donated). ``run`` is one ``lax.while_loop`` that returns to the host when a row finishes (or after
``max_steps`` steps, for streaming). Programs compiled: one ``run`` (and ``step``), and two ``admit`` per prompt
bucket (prompts padded to powers of two from 32): one row, or all S (a group of k > S / 2 requests is padded to S,
fewer are admitted one by one). ``RunStats.programs`` counts them; every engine shares one bounded table
(``programs.PROGRAMS``), so engines of the same spec and shapes compile once.

Exactness: a row's tokens depend on its prompt, its settings and its key only (per-row sampling settings and keys;
every layer is row-local), so its greedy output equals decoding that prompt alone, and a sampled row draws the same
tokens whatever batch it is in. Adaptive verify (``verify_lengths``) is the exception for acceptance: one verify
length for the batch, chosen from every running row's confidence, so a row's verify (and acceptance) lengths, and a
sampled row's tokens, depend on its company (the output law, and greedy output, stay exact)."""
from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import time
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from dflash_jax import sharding
from dflash_jax.decode import load_policy, prepare, steps
from dflash_jax.decode.constrained import Constraints
from dflash_jax.decode.options import DecodeOptions, Request
from dflash_jax.decode.pages import PagePool
from dflash_jax.decode.programs import PROGRAMS, signature
from dflash_jax.decode.types import DecodeState, Finish, GenerationResult, row_result
from dflash_jax.grammar import Grammar
from dflash_jax.kernels import tiling
from dflash_jax.state import NO_PAGE
from dflash_jax.target import Target

FOREVER = 2 ** 31 - 1  # ``run``'s step limit when only a finishing row should return
PAGE = 16  # tokens per page of the paged caches (``Engine``'s default on TPU / GPU)
# and on CPU, where the paged attention loop reads a tile of 128 keys: one page of 128 is a slice, 8 pages of 16 a
# gather that XLA:CPU copies element by element (the demo target's plain server, one user: 0.67x -> 0.80-0.82x of
# the engine's batch-1 speed; a plain step 1.16 ms at pages of 16 or 64, the closed batch's 0.87 at 128); vLLM's
# CPU backend also pages by 128
CPU_PAGE = 128
_ADMISSIONS = itertools.count()  # admission order across engines (only its order within one engine is read)
LOOKAHEAD_STEPS = 8  # a run gives each running row pages for this many more steps (then returns for more)
LOOKAHEAD_PAGES = 4  # and at least this many pages more (plain decoding's steps commit one token each)
RESULT_PROGRAMS = ("take", "release")  # a finished row's results read and its slot freed: not counted in RunStats
PROGRESS_STEPS = 64  # the most steps one ``progress`` read covers (it reads for a power of two of them: few programs)
PROBE_STEPS = 8  # steps each (bucket, block) program is timed for (``Engine.probe_costs``)
PROBE_ROUNDS = 3  # the best of this many rounds over the blocks
PROBE_PROMPT = 64  # tokens of the probes' prompts
WARM_GRAMMAR = Grammar.regex("[a-z ]*")  # what ``warm(grammars=True)`` constrains its row with (any grammar would do)


@dataclasses.dataclass(frozen=True)
class Launched:
    """A run and the read of its progress, dispatched by ``Engine.launch`` (device arrays until ``collect``); a read
    alone (``Engine.read``): no spec, nothing taken."""

    spec: object
    taken: object
    read: dict
    begun: float  # when it was launched (perf_counter)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A preempted request (its pages were needed): admitted again (``Engine.admit``) it is prefilled from its
    committed tokens and continues with the decode fields it had (``saved``: tokens, counters, key), so its output is
    the one it would have given uninterrupted."""

    request: Request
    saved: dict  # ``steps.RESUMED`` of the row, host arrays

    @property
    def committed(self) -> int:
        """Tokens its caches held: prompt + generated, the pending token excluded."""
        return int(self.saved["prompt_len"]) + int(self.saved["generated"]) - 1

    @property
    def prompt_ids(self) -> list[int]:
        return self.saved["tokens"][:self.committed].tolist()

    @property
    def stream(self) -> int:
        return self.request.stream


class Engine:
    """S = ``max_batch`` slots decoding with ``options`` (the defaults of every request). ``max_length``: the most
    tokens (prompt + generated) a row may hold, which sizes every slot's cache (default: ``options.max_length``).
    ``sampled``: requests may sample (temperature > 0); default: only when ``options.temperature`` > 0 (a greedy
    engine compiles argmax only and refuses sampled requests).

    Paged (``page`` > 0, the default; not on a mesh that splits rows over data): the full-attention caches of the
    target and the draft are pages of one pool (``kv_cache_memory`` bytes, default: every row at ``max_length``),
    a row holding pages for its tokens only; ``run`` steps the running rows alone, padded to a power of two (one
    program per bucket), and when the pool runs dry the newest rows are preempted (``take_preempted``: admitted
    again later, their outputs unchanged). ``page``: tokens per page (default ``default_page()``: 128 on CPU, 16 on
    TPU / GPU); 0: every row owns a cache of ``max_length`` (slots).

    ``block_policy`` (a draft's chain, no adaptive verify): "auto" = the block each ``run`` verifies follows the
    load (``load_policy.BlockPolicy``: step costs per bucket of live rows and block measured by ``warm``, acceptance
    observed from every released request; plain steps where drafting does not pay); or any object with
    ``choose(bucket) -> block`` and ``observe(results)``; None: every step verifies the block.

    ``tokenizer`` (a Hugging Face fast tokenizer): requests may carry a grammar (``Request.grammar``, structured
    outputs: ``decode.constrained``); while such a row runs, each step of a ``run`` has the host between its draft and
    its verify (a paged run takes at most ``LOOKAHEAD_STEPS`` of them: the steps its rows were given pages for)."""

    def __init__(self, target: Target, draft, options: DecodeOptions, *, max_batch: int, max_length: int | None = None,
                 sampled: bool | None = None, stop_width: int = 8, page: int | None = None,
                 kv_cache_memory: int | None = None, prefix_cache: bool = True, block_policy=None, tokenizer=None):
        if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        max_length = max_length or options.max_length
        if max_length is None:
            raise ValueError("Engine needs max_length (the most prompt + generated tokens a row holds: it sizes "
                             "every slot's cache)")
        limit = min(max_length, target.config.max_position_embeddings)
        self.target, self.draft, self.options, self.max_length = target, draft, options, limit
        self.sampled = options.temperature > 0 if sampled is None else bool(sampled)
        if options.temperature > 0 and not self.sampled:
            raise ValueError("options.temperature > 0 needs a sampled engine (sampled=True)")
        mesh = sharding.mesh_of(target.params)
        page = default_page(mesh) if page is None else page
        if not isinstance(page, (int, np.integer)) or page < 0:
            raise ValueError(f"page must be an integer >= 0 (tokens per cache page; 0: no paging), got {page!r}")
        cache_len = prepare.cache_length([1], [limit - 1], options.max_block(draft), options.cache_len)
        self.unit = sharding.batch_multiple(mesh)  # rows split over data*fsdp: every group a multiple of it
        self.rows = int(max_batch) + sharding.pad_rows(int(max_batch), mesh)
        page = int(page) if self.unit == 1 else 0  # a pool is not split over data: such meshes keep slots
        if page:
            cache_len = prepare.round_up(cache_len, page)
        self.spec, self.inputs = prepare.engine(target, draft, options, cache_len, greedy=not self.sampled,
                                                rows=self.rows, stop_width=stop_width, page=page)
        self.pool = self._pool(kv_cache_memory) if page else None
        self.prefix_cache = bool(prefix_cache) and self.paged and steps.pages_every_layer(self.spec)
        self._prefix_refused = bool(prefix_cache) and self.paged and not self.prefix_cache
        self.cached_tokens = 0  # prompt tokens admitted from cached pages (not prefilled), over the engine's life
        self._cached: dict[int, int] = {}  # row -> its prompt tokens that came from cached pages
        self._need: dict[int, int] = {}  # row -> the most positions it may ever write (paged)
        self._order: dict[int, int] = {}  # row -> its admission's sequence number (the newest is preempted first)
        self._requests: dict[int, Request] = {}
        self._logprobs: dict[int, bool] = {}  # row -> its request asked for log-probabilities
        self.constraints = Constraints(tokenizer, target.config.vocab_size)  # rows with a grammar
        self._preempted: list[tuple[int, Resumed]] = []
        self.programs = PROGRAMS
        self._inputs_signature = signature(self.inputs)  # the params' tree: fixed for the engine's life
        self.used: set = set()  # the programs this engine ran (each compiled once per process, shared)
        self._quick: dict = {}  # (name, signature of the arguments after the state) -> the executable
        self._seen = None  # (finish, lengths) of the current state on the host, while no call has changed them
        self._unread: collections.deque[int] = collections.deque()  # launches not collected: positions each may write
        self._last_read = None  # (finish, lengths) of the newest collected launch
        self._placed = -1  # the pool's version the current state's block tables hold
        self._admitted_at: dict[int, float] = {}
        self.block_policy = self._policy(block_policy, options)

    def _policy(self, policy, options: DecodeOptions):
        """``block_policy`` checked: None, "auto" (kept as such until ``warm`` measures the costs), or a policy."""
        if policy is None:
            return None
        if not (self.spec.speculative and not self.spec.tree_budget and not self.spec.verify_lengths
                and options.proposer is None):
            raise ValueError("block_policy needs a draft's chain (block > 1), without tree_budget, verify_lengths "
                             "or a custom proposer")
        if policy != "auto" and not (callable(getattr(policy, "choose", None))
                                     and callable(getattr(policy, "observe", None))):
            raise ValueError(f"block_policy must be None, 'auto' or an object with choose(bucket) and "
                             f"observe(results), got {policy!r}")
        return policy

    @property
    def _chooser(self):
        """The block policy in force: None without one, or while "auto" has not measured its costs (``warm``)."""
        return None if self.block_policy in (None, "auto") else self.block_policy

    def _pool(self, kv_cache_memory: int | None) -> PagePool:
        """The page pool: ``kv_cache_memory`` bytes of pages (default: every row at the max length)."""
        columns = self.spec.cache_len // self.spec.page
        per_page = self.page_bytes
        pages = self.rows * columns
        longest = min(-(-(self.max_length - 1 + self.spec.max_block) // self.spec.page), columns)
        if kv_cache_memory is not None:
            if not isinstance(kv_cache_memory, (int, np.integer)) or kv_cache_memory < 1:
                raise ValueError(f"kv_cache_memory must be a number of bytes >= 1, got {kv_cache_memory!r}")
            pages = int(kv_cache_memory) // max(per_page, 1)
            if pages < longest:
                raise ValueError(f"kv_cache_memory {kv_cache_memory} bytes holds {pages} pages of {self.spec.page} "
                                 f"tokens ({per_page} bytes each); one row of the max length ({self.max_length} "
                                 f"tokens and a block) needs {longest} pages = {longest * per_page} bytes")
        return PagePool(pages, self.spec.page, self.rows, columns)

    @property
    def paged(self) -> bool:
        return self.pool is not None

    def update_params(self, target_params, draft_params=None) -> None:
        """Swap in new weights of the target (and the draft) between rollouts, compiling nothing: each tree must have
        the current one's paths, shapes and dtypes (else ValueError naming the first leaf that differs) and is placed
        on its shardings. Refused while rows hold requests (their caches hold the old weights' K/V): release every
        row, and take the preempted ones, first. Cached prompt pages are dropped for the same reason."""
        if self._requests or self._preempted:
            raise ValueError(f"update_params with {len(self._requests)} rows admitted and {len(self._preempted)} "
                             "preempted: their caches hold the old weights'; release every row first")
        if draft_params is not None and self.inputs.dparams is None:
            raise ValueError("draft_params given, but this engine decodes without a draft")

        def placed(new, old, what: str):
            """``new`` laid out as ``old`` (its tree, its shardings), or ValueError at the first leaf that differs."""
            olds, news = ({jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(t)}
                          for t in (old, new))
            kind = lambda x: "absent" if x is None else f"{np.shape(x)} {getattr(x, 'dtype', type(x).__name__)}"  # noqa
            for path in [*olds, *(p for p in news if p not in olds)]:
                if kind(olds.get(path)) != kind(news.get(path)):
                    raise ValueError(f"{what} parameter {path}: the new one is {kind(news.get(path))}, the engine's "
                                     f"{kind(olds.get(path))} (update_params keeps shapes and dtypes: no recompiling)")
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(old), [
                jax.device_put(news[p], getattr(x, "sharding", None)) for p, x in olds.items()])

        tparams = placed(target_params, self.inputs.tparams, "target")
        dparams = self.inputs.dparams if draft_params is None else placed(draft_params, self.inputs.dparams, "draft")
        if self.paged:  # no later prompt may share pages of the old weights' K/V
            self.pool.drop_cached()
        self.inputs = self.inputs.replace(tparams=tparams, dparams=dparams)
        self.target = dataclasses.replace(self.target, params=tparams)
        if draft_params is not None:
            self.draft = dataclasses.replace(self.draft, params=dparams)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: its tokens' K/V in every paged layer of the target and the draft."""
        return steps.page_bytes(self.spec, self.inputs) if self.spec.page else 0

    def describe(self) -> str:
        """One line: the cache's pages, tokens and rows (the start-up line of a server)."""
        if not self.paged:
            return f"{self.rows} slots of {self.spec.cache_len} tokens"
        p = self.pool
        sharing = ("prefix caching on" if self.prefix_cache else
                   "prefix caching off: this model keeps sliding-window rings or recurrent states per row, which "
                   "pages cannot share" if self._prefix_refused else "prefix caching off")
        return (f"{p.pages} pages of {p.page} tokens = {p.pages * p.page} tokens "
                f"({p.pages * self.page_bytes / 2 ** 20:.1f} MiB: {p.pages * p.page // self.max_length} rows at the max "
                f"length, more when shorter), up to {self.rows} rows in flight; {sharing}")

    # --- programs -------------------------------------------------------------------------------------------
    def _compiled(self, name: str, fn, *args, spec=None, **static):
        """The executable of ``fn`` for ``args`` (the state first: of one structure for the engine's life, so a
        program is looked up by its other arguments' signature, cheaply, on every step) and its ``static``
        keywords; ``spec``: the engine's, or a step block's (``EngineSpec.at_block``). An executable, unlike a
        jitted function, takes its arguments whether or not they are committed to a device (a state from a run is,
        an empty one is not): what ``warm`` compiled is what serving calls."""
        spec = spec or self.spec
        fixed = tuple(sorted(static.items()))
        quick = (name, spec.load_block, spec.logprobs, fixed, signature(*args[1:]))  # what a step's spec may vary
        if quick not in self._quick:
            key = (name, spec, self._inputs_signature, signature(*args), fixed)
            self.used.add(key)
            self._quick[quick] = self.programs.get(key, lambda: fn.lower(spec, self.inputs, *args, **static).compile())
        return self._quick[quick]

    def empty(self) -> DecodeState:
        """A state of S free rows (paged: every page free, none cached: its pools hold nothing yet, so a prompt
        cached in an earlier state's pages is prefilled again)."""
        rows = self._rows([Request([0])], [self.options], [1], pad_to=self.rows, bucket=1)
        self._seen, self._last_read = None, None
        self._unread.clear()  # the old state's launches are nobody's now
        if self.paged:
            for r in range(self.rows):
                self._forget(r)
            self._preempted.clear()
            self.pool.drop_cached()
        state = steps.empty_jit(self.spec, self.inputs, rows, self.pool.pages if self.paged else 0)
        # committed to its devices (no copy), as every program's output is: a call's fast path is kept per kind of
        # argument, so programs warmed on an uncommitted empty state took the slow first call again when serving
        # (an admission's: about 9 ms of host time on CPU)
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, x.sharding), state)

    def _rows(self, requests, settings, budget, pad_to, bucket=None, starts=None):
        prompts = [np.asarray(r.prompt_ids, np.int32) for r in requests]
        starts = [0] * len(prompts) if starts is None else starts
        longest = max(len(p) - s for p, s in zip(prompts, starts))  # what the prefill runs
        bucket = bucket or prepare.prompt_bucket(longest, self.spec.cache_len)
        rows = prepare.make_rows(self.spec, prompts, budget, settings, [r.stream for r in requests], pad_to=pad_to,
                                 bucket=bucket, starts=starts)
        return prepare.place_rows(self.spec, rows)

    def groups(self) -> list[int]:
        """The admission group sizes: one row (a row per data shard on a mesh), or every row (``admit``)."""
        return sorted({self.unit, self.rows})

    def buckets(self) -> list[int]:
        """The row counts a paged ``run`` is compiled for (``row_buckets``)."""
        return row_buckets(self.rows) if self.paged else [self.rows]

    def buckets_up_to(self, most_rows: int | None) -> list[int]:
        """The buckets that runs of at most ``most_rows`` running rows step in (None: every bucket)."""
        every = self.buckets()
        top = every[-1] if most_rows is None else next((b for b in every if b >= most_rows), every[-1])
        return [b for b in every if b <= top]

    def _warm_rows(self, most_rows: int | None) -> list[int]:
        """How many rows to run so that each run program up to ``most_rows`` rows compiles: a bucket's worth,
        paged; one, unpaged (every row steps whatever runs)."""
        return self.buckets_up_to(most_rows) if self.paged else [1]

    def warm(self, prompt_lengths: Iterable[int], most_rows: int | None = None, *,
             tails: Iterable[int] | None = None, streaming: bool = False, grammars: bool = False) -> None:
        """Compile, and run once on a scratch state, every program a run over prompts of these lengths can use
        (each admission group x prompt bucket; ``run`` of every row bucket up to ``most_rows`` rows, ``release``),
        so that timings exclude compilation and first-run setup (on CPU a cold first run is several times
        slower). With prefix caching a hit prefills a prompt's tail: ``tails``, the tail lengths hits may prefill
        (None: any length below the longest prompt, a server's case), get their buckets and the cached tokens'
        writes compiled too. ``streaming``: also every ``progress`` read (a server's). ``grammars``: also a row with a
        grammar: its admission, and its constrained steps among every bucket of rows up to ``most_rows``
        (``_warm_constrained``). ``block_policy="auto"``: the step costs of every bucket up to ``most_rows`` at every
        candidate block are measured here (``probe_costs``), which makes the policy. The engine's pages are left as
        they were."""
        lengths = list(prompt_lengths)
        tails = list(range(1, max(lengths)) if tails is None else tails) if self.prefix_cache else []
        buckets = sorted({prepare.prompt_bucket(n, self.spec.cache_len) for n in lengths + tails})
        kept = self._bookkeeping()
        self.prefix_cache = False  # the dummy prompts repeat: hits would skip the prefill programs to compile
        try:
            for b in buckets:  # one prompt of the bucket's length makes the group's program: the others are short
                for g in self.groups():
                    n = 1 if g == self.unit else g // 2 + 1
                    self._warm_run([Request([0] * min(b, self.max_length - 1))] + [Request([0])] * (n - 1))
            # every bucket's run, by 1-token prompts that run a step (a prompt above that fills max_length is done
            # at its prefill: no run)
            for n in self._warm_rows(most_rows):
                self._warm_run([Request([0], stop_token_ids=[])] * n)
            state = self.empty()
            for k in range(PROGRESS_STEPS.bit_length()) if streaming else []:  # every read a streaming host makes
                self.progress(state, 1 << k)
            for b in buckets if tails else []:  # a hit's cached tokens written beside its tail's prefill (one row)
                state = self._put_prefix(state, np.full((self.unit,), self.rows), [Request([0] * b)], [b])
            if grammars:
                self._warm_constrained(buckets, most_rows)
        finally:
            self._bookkeeping(kept)
        if self.block_policy == "auto":
            self.block_policy = load_policy.BlockPolicy(self.probe_costs(most_rows), load_policy.Acceptance())

    def probe_costs(self, most_rows: int | None = None, blocks: Sequence[int] | None = None,
                    on_probe=None) -> dict:
        """(bucket, block) -> seconds of one engine step of ``bucket`` running rows verifying ``block`` tokens, for
        every row bucket up to ``most_rows`` and every block of ``blocks`` (default: ``load_policy.candidates``):
        the bucket's rows of a ``PROBE_PROMPT``-token dummy prompt, its program compiled and run one step, then
        ``PROBE_STEPS`` steps timed, the best of ``PROBE_ROUNDS`` rounds over the blocks in turn. A bucket whose
        rows the pool cannot hold is left out. Greedy rows: a sampled row's draws are not in the cost.
        ``on_probe(bucket, block, seconds)`` after each. The engine's pages are left as they were."""
        blocks = list(blocks or load_policy.candidates(self.spec.block_size))
        buckets = self.buckets_up_to(most_rows)
        length = min(PROBE_PROMPT, self.max_length // 2)
        budget = self.max_length - length
        kept, policy = self._bookkeeping(), self.block_policy
        self.prefix_cache, self.block_policy = False, None  # the dummy prompts repeat; their steps teach nothing
        out = {}
        try:
            for b in buckets:
                requests = [Request([0] * length, max_new_tokens=budget, stop_token_ids=[])] * b
                best = {}
                for _ in range(PROBE_ROUNDS):  # the blocks in turn, so that the machine's drift lands on each
                    for k in blocks:
                        state = self.empty()
                        if not self.can_admit(requests):
                            break
                        state, rows = self.admit(state, requests)
                        state, _ = self.run(state, 1, block=k)
                        jax.block_until_ready(state.finish)
                        t = time.perf_counter()
                        state, taken = self.run(state, PROBE_STEPS, block=k)
                        jax.block_until_ready(state.finish)
                        if taken:
                            best[k] = min(best.get(k, np.inf), (time.perf_counter() - t) / taken)
                        self.release(state, rows)
                for k, seconds in best.items():
                    out[b, k] = seconds
                    if on_probe is not None:
                        on_probe(b, k, seconds)
        finally:
            self._bookkeeping(kept)
            self.block_policy = policy
        if not out:
            raise ValueError("probe_costs: the page pool holds no probe row (a prompt of "
                             f"{length} tokens and a budget of {budget})")
        return out

    def _warm_run(self, requests: list[Request]) -> None:
        """Admit ``requests`` into an empty state, one step, release: unless the pool could never hold them (a
        program no run of this pool can use)."""
        state = self.empty()
        if self.can_admit(requests):
            state, rows = self.admit(state, requests)
            state, _ = self.run(state, 1)
            jax.block_until_ready(self.release(state, rows)[0])

    def _warm_constrained(self, buckets: Sequence[int], most_rows: int | None = None) -> None:
        """A row with a grammar admitted with a prompt of each of ``buckets`` (the first token's masked draw); then,
        for every bucket of live rows up to ``most_rows``, a grammar row among that many running rows through a
        constrained step at every block a run may verify (the policy's candidates, else the engine's block): while
        one row has a grammar, every step of its bucket is a constrained one, so that a first request with a
        grammar, alone or among others, compiles nothing."""
        try:
            self.constraints.grammars  # noqa: B018 (llguidance's view of the tokenizer, built once)
        except (ImportError, ValueError):  # no grammars here: each request with one is refused, saying why
            return
        blocks = load_policy.candidates(self.spec.block_size) if self.block_policy is not None else [None]

        def request(prompt: int, grammar=WARM_GRAMMAR) -> Request:
            n = min(prompt, self.max_length - 2)
            budget = min(len(blocks) * self.spec.max_block + 1, self.max_length - n - 1)
            return Request([0] * n, max_new_tokens=budget, stop_token_ids=[], grammar=grammar)

        for i, b in enumerate(buckets):
            first = [request(b)]
            for n in self._warm_rows(most_rows) if i == 0 else [1]:  # the first also steps every bucket
                warm = first + [request(1, None)] * (n - 1)
                if not self.can_admit(warm):
                    continue
                state, at = self.admit(self.empty(), warm)
                for k in blocks if i == 0 else []:
                    state, _ = self.run(state, 1, block=k)
                jax.block_until_ready(self.release(state, at)[0])

    def _bookkeeping(self, kept=None):
        """The host's record of one state (pages, admissions) -> a copy; ``kept`` given: put it back."""
        names = ("pool", "_need", "_order", "_requests", "_preempted", "_admitted_at", "_seen", "_placed",
                 "_cached", "cached_tokens", "prefix_cache", "_unread", "_last_read")
        if kept is None:
            return {n: copy.deepcopy(getattr(self, n)) for n in names}
        for n in names:
            setattr(self, n, kept[n])

    # --- the public steps -----------------------------------------------------------------------------------
    def check(self, requests: Sequence[Request | Resumed], first: int = 0) -> list[DecodeOptions]:
        """Each request's settings, checked (prompt ids, length, budget, sampling) before any compute."""
        settings = []
        for i, r in enumerate(requests):
            if isinstance(r, Resumed):
                settings.append(r.request.settings(self.options))
                continue
            if not isinstance(r, Request):
                raise ValueError(f"request {first + i}: expected a decode.Request, got {type(r).__name__}")
            prepare.check_prompts(self.target, [list(r.prompt_ids)])  # raises naming the bad id
            s = r.settings(self.options)
            if s.temperature > 0 and not self.sampled:
                raise ValueError(f"request {first + i} samples (temperature {s.temperature}) but this engine is greedy: "
                                 "build it with sampled=True")
            if len(s.stop_token_ids) > self.spec.stop_width:
                raise ValueError(f"request {first + i} has {len(s.stop_token_ids)} stop ids; this engine holds "
                                 f"{self.spec.stop_width} per row (stop_width)")
            prepare.budgets([len(r.prompt_ids)], [s], self.max_length, first + i)  # the pool holds any such row
            if r.grammar is not None:
                try:
                    self.constraints.check(r.grammar, self.spec)
                except ValueError as e:
                    raise ValueError(f"request {first + i}: {e}") from e
            settings.append(s)
        return settings

    def _most(self, prompt: int, budget: int) -> int:
        """The most positions a row of this prompt and budget writes: its tokens but the last, then a block."""
        return min(prompt + budget - 1 + self.spec.max_block, self.spec.cache_len)

    def free_rows(self, state: DecodeState) -> list[int]:
        """Rows holding no request."""
        finish = np.asarray(sharding.to_host(state.finish))
        return [i for i in range(self.rows) if finish[i] == Finish.FREE]

    def finished_rows(self, state: DecodeState) -> list[int]:
        """Rows whose request is done (length or stop) and not yet released."""
        finish = np.asarray(sharding.to_host(state.finish))
        return [i for i in range(self.rows) if finish[i] in (Finish.LENGTH, Finish.STOP)]

    def can_admit(self, requests: Sequence[Request | Resumed]) -> bool:
        """Whether the pool has the pages to prefill ``requests`` now (always, unpaged)."""
        if not self.paged:
            return True
        hits = [self._hit(r)[1] for r in requests]
        need = sum(self.pool.pages_for(len(r.prompt_ids)) - len(h) for r, h in zip(requests, hits))
        return need <= self.pool.available() - self.pool.pinned([p for h in hits for p in h])

    def _hit(self, request) -> tuple[list[int], list[int]]:
        """(the hashes of the request's prompt pages a row may share: full pages, the last prompt token left to
        prefill; the cached pages of their longest cached run)."""
        if not self.prefix_cache:
            return [], []
        ids = request.prompt_ids
        hashes = self.pool.chain(ids, self.pool.page, (len(ids) - 1) // self.pool.page)
        return hashes, self.pool.lookup(hashes)

    def admit(self, state: DecodeState, requests: Sequence[Request | Resumed],
              rows: Sequence[int] | None = None) -> tuple[DecodeState, list[int]]:
        """Prefill ``requests`` (or preempted ones, ``Resumed``) into free rows (``rows``, or the lowest free ones)
        -> (state, the rows they took). The other rows keep their caches; more than S / 2 requests are one prefill of
        S rows (padded), fewer one prefill each (two programs per prompt bucket, whatever S). Paged: the pool must
        have pages for the prompts (``can_admit``), else ValueError."""
        begun = time.perf_counter()  # a row's wall time counts its prefill
        requests = list(requests)
        if not requests:
            return state, []
        if self._unread:
            raise ValueError("collect every launch before admitting (a launched run does not step the new rows)")
        self._seen = None
        settings = self.check(requests)
        host = sharding.to_host((state.finish, state.tcache.lengths) if self.paged else (state.finish,))
        free = np.flatnonzero(np.asarray(host[0]) == int(Finish.FREE)).tolist()
        rows = free[:len(requests)] if rows is None else [int(r) for r in rows]
        if len(rows) < len(requests):
            raise ValueError(f"{len(requests)} requests, {len(free)} free rows")
        if len(rows) != len(requests) or any(r not in free for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} must be {len(requests)} distinct free rows (free: {free})")
        if not self.can_admit(requests):
            raise ValueError(f"the page pool has {self.pool.available()} free pages of {self.pool.page} tokens, too "
                             f"few for these {len(requests)} prompts: admit them when rows are released")
        lens = [len(r.prompt_ids) for r in requests]
        budget = prepare.budgets(lens, settings, self.max_length)
        for r, req, b in zip(rows, requests, budget):
            full = req.saved if isinstance(req, Resumed) else None
            self._forget(r)
            if self.paged:
                self._need[r] = self._most(int(full["prompt_len"]) if full else len(req.prompt_ids),
                                           int(full["budget"]) if full else int(b))
            self._order[r] = next(_ADMISSIONS)
            self._requests[r] = req.request if isinstance(req, Resumed) else req
        self._logprobs.update({r: s.logprobs is not None for r, s in zip(rows, settings)})
        for r, req in zip(rows, requests):  # cached pages held at once: no row's growth below may evict them
            if self.prefix_cache:
                self.pool.share(r, self._hit(req)[1])
        for group in self._groups(requests):  # a group's prompts share the pages cached before its prefill
            hits = [self._hit(requests[i]) for i in group]
            starts = []
            for i, (_, pages) in zip(group, hits):
                if self.paged:
                    self.pool.share(rows[i], pages[int(self.pool.owned[rows[i]]):])  # an earlier group's pages too
                    if not self.pool.grow(rows[i], lens[i]):  # can_admit counted the pages: never
                        raise RuntimeError(f"row {rows[i]}: the pool lost the pages can_admit counted")
                starts.append(len(pages) * (self.pool.page if self.paged else 0))
            size = self.unit if len(group) == 1 else self.rows
            at = np.full((size,), self.rows, np.int32)  # padding rows go past the state: dropped
            at[:len(group)] = [rows[i] for i in group]
            new = self._rows([requests[i] for i in group], [settings[i] for i in group], budget[list(group)],
                             pad_to=size, starts=starts)
            first = [self.constraints.start(rows[i], self._requests[rows[i]].grammar,
                                            not isinstance(requests[i], Resumed), settings[i].temperature == 0)
                     for i in group]
            if any(m is not None for m in first):  # grammars: the first token's masks
                allowed = np.full((size, self.constraints.grammars.words), -1, np.int32)
                for j, m in enumerate(first):
                    allowed[j] = -1 if m is None else m
                new = new.replace(allowed=allowed)
            args = (state, new, at)
            if self.paged:  # padding rows: no pages, every write dropped
                args += (np.where((at < self.rows)[:, None], self.pool.table[np.minimum(at, self.rows - 1)], NO_PAGE),)
            state = self._compiled("admit", steps.admit_jit, *args)(self.inputs, *args)
            for i, (hashes, _), start in zip(group, hits, starts):
                if self.prefix_cache:
                    self.pool.register(rows[i], hashes)
                self._cached[rows[i]] = start
                self.cached_tokens += start
            if any(starts):
                state = self._put_prefix(state, at, [requests[i] for i in group], starts)
        resumed = [(r, q.saved) for r, q in zip(rows, requests) if isinstance(q, Resumed)]
        if resumed:
            at = np.asarray([r for r, _ in resumed], np.int32)
            saved = {f: np.stack([s[f] for _, s in resumed]) for f in steps.RESUMED}
            state = steps.restore_jit(self.spec, state, at, saved)
        if self.spec.proposer is not None:  # a proposer's per-request arrays follow its rows (the replay draft's)
            self.inputs = self.inputs.replace(proposer_args=self.spec.proposer.admitted(
                self.spec, self.inputs.proposer_args, rows, [self._requests[r].stream for r in rows]))
        self._admitted_at.update({r: begun for r in rows})
        if self.paged:  # what a launch before the next read gives pages from: the new rows hold their prompts
            finish, lengths = np.array(host[0]), np.array(host[1])
            for r, req in zip(rows, requests):
                finish[r], lengths[r] = int(Finish.RUNNING), len(req.prompt_ids)
            self._last_read = (finish, lengths)
        return state, rows

    def _groups(self, requests) -> list[list[int]]:
        """The prefill programs of one admission, as lists of request indices: more than S / 2 requests are one
        program of S rows, fewer one each. With prefix caching, the requests whose first shareable page another
        request of the call also opens with (the n samples of one prompt) are prefilled after it, so that they
        share its pages instead of prefilling the same prompt in the same program."""
        leaders, followers, seen = [], [], set()
        for i, req in enumerate(requests):
            hashes = self._hit(req)[0][:1]
            (followers if hashes and hashes[0] in seen else leaders).append(i)
            seen.update(hashes)
        return [g for phase in (leaders, followers) if phase
                for g in ([phase] if 2 * len(phase) > self.rows else [[i] for i in phase])]

    def _put_prefix(self, state: DecodeState, at, requests, starts) -> DecodeState:
        """The cached prefixes' tokens into the token rows ``at`` (its admission's rows, padded as its prefill: one
        program per group size and prefix bucket) of ``requests`` (their prefill wrote the rest)."""
        width = prepare.prompt_bucket(max(starts), self.spec.cache_len)
        prefix, begin = np.zeros((len(at), width), np.int32), np.zeros((len(at),), np.int32)
        for j, (req, start) in enumerate(zip(requests, starts)):
            prefix[j, :start], begin[j] = req.prompt_ids[:start], start
        return steps.put_prefix_jit(state, np.asarray(at, np.int32), prefix, begin)

    def step(self, state: DecodeState) -> DecodeState:
        """One draft + verify + commit of every running row."""
        if self.paged or self.constraints.rows:
            return self.run(state, 1)[0]
        spec, _ = self._step_spec(self.rows, None, 1)
        return self._compiled("step", steps.step_jit, state, spec=spec)(self.inputs, state)

    def run(self, state: DecodeState, max_steps: int = FOREVER, *, block: int | None = None
            ) -> tuple[DecodeState, int]:
        """Steps on the device until a running row finishes, none runs, or ``max_steps`` steps -> (state, steps).
        Paged: the running rows only (padded to a power of two), after giving each pages for its next steps; rows
        the pool cannot hold are preempted first (``take_preempted``); a row short of pages also returns. Each step
        verifies ``block`` tokens (1: plain steps; default: the block policy's choice for the bucket, else the
        engine's block)."""
        state, spec, taken = self._dispatch(state, max_steps, block)
        return state, self._ran(spec, int(taken))

    def launch(self, state: DecodeState, max_steps: int, *, block: int | None = None
               ) -> tuple[DecodeState, Launched | None]:
        """``run`` of at most ``max_steps`` (<= ``PROGRESS_STEPS``) steps and the ``progress`` read after it,
        dispatched without waiting (``collect`` brings them to the host): the host streams the last run's tokens
        while the device steps this one. While a launch is not collected the running rows' lengths are bounded
        (the last read, plus the block for each step launched since) to give them pages; a row the pool could not
        give them would be preempted, which waits for the reads: then nothing is dispatched (None), and the
        caller collects its launches and calls again."""
        if not 1 <= max_steps <= PROGRESS_STEPS:
            raise ValueError(f"launch runs 1 to {PROGRESS_STEPS} steps, asked {max_steps}")
        begun = time.perf_counter()
        dispatched = self._dispatch(state, max_steps, block, wait=False)
        if dispatched is None:
            return state, None
        state, spec, taken = dispatched
        return state, self._out(Launched(spec, taken, self._read(state, max_steps), begun),
                                int(max_steps) * self.spec.max_block)

    def read(self, state: DecodeState) -> Launched:
        """``progress`` of one step dispatched without waiting (``collect`` brings it in, in launch order): after an
        admission, its rows' first tokens."""
        return self._out(Launched(None, 0, self._read(state, 1), time.perf_counter()), 0)

    def _out(self, launched: Launched, positions: int) -> Launched:
        """``launched`` on its way to the host (its copies started); ``positions``: the most its run writes a row."""
        for leaf in jax.tree_util.tree_leaves((launched.taken, launched.read)):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        self._unread.append(positions)
        return launched

    def collect(self, launched: Launched) -> tuple[int, dict]:
        """The oldest launch not collected, on the host -> (steps it took, its ``progress`` read)."""
        taken, out = sharding.to_host((launched.taken, launched.read))
        self._unread.popleft()
        self._last_read = (out["finish"], out.pop("lengths"))
        return (self._ran(launched.spec, int(taken)) if launched.spec is not None else 0), out

    def _dispatch(self, state: DecodeState, max_steps: int, block: int | None, wait: bool = True):
        """``run``'s program dispatched -> (state, its spec, the steps it takes: on the device, or on the host for
        constrained steps); None when ``wait`` is False and running rows would be preempted (``launch``)."""
        if not self.paged:
            spec, n = self._step_spec(self.rows, block, max_steps)
            if self.constraints.rows:
                state, taken = self._constrained(state, np.arange(self.rows, dtype=np.int32), spec, int(n))
                return state, spec, taken
            state, taken = self._compiled("run", steps.run_jit, state, n, spec=spec)(self.inputs, state, n)
            return state, spec, taken
        reserved = self._reserve(state, preempt=wait or not self._unread)
        if reserved is None:
            return None
        state, live = reserved
        self._seen = None
        if not live:
            return state, self.spec, 0
        at = np.full((next(b for b in self.buckets() if b >= len(live)),), self.rows, np.int32)
        at[:len(live)] = live
        state = self._tables(state)
        spec, n = self._step_spec(len(at), block, max_steps)
        if self.constraints.live(live):  # the steps the rows have pages for (``_reserve``)
            state, taken = self._constrained(state, at, spec, min(int(n), LOOKAHEAD_STEPS))
            return state, spec, taken
        state, taken = self._compiled("run_rows", steps.run_rows_jit, state, at, n, spec=spec)(self.inputs, state,
                                                                                              at, n)
        return state, spec, taken

    def _constrained(self, state: DecodeState, at, spec, most: int) -> tuple[DecodeState, int]:
        """Steps of the rows ``at`` with their grammars' masks (``decode.constrained``) until a row that was running
        finishes, none runs, or ``most`` steps -> (state, steps taken). Each: the proposal drafted and read with the
        rows' newest tokens and finish (a plain step reads those as the step before returned them), the matchers
        brought up to date, the masks along the proposal, the masked verify and commit; one wait for the device a
        step (a proposal drafted when a row has just finished is dropped). A plain step is two programs, the target's
        forward of the rows' pending tokens and the masked draw + commit, and the next step's forward is dispatched
        before the host reads what this one committed: the masks are computed while the forward runs (a forward
        whose step never comes, the run ending, stays uncommitted: the rollback protocol overwrites it)."""
        running, taken, seen, logits = None, 0, None, None
        forward = None if spec.drafting else self._compiled("forward_rows", steps.forward_rows_jit, state, at,
                                                            spec=spec)
        finish = None  # the masked draw + commit, looked up once a run: its operands' shapes are the run's
        while taken < most:
            given = proposal = candidates = None
            if spec.drafting:  # the proposal, its candidates and the rows' newest tokens in one program
                given, top, seen = self._compiled("propose_rows", steps.propose_rows_jit, state, at, spec=spec)(
                    self.inputs, state, at)
                proposal, candidates, seen = sharding.to_host((given.tokens, top, seen))
            elif seen is not None:  # a plain step: what the last step returned
                seen = sharding.to_host(seen)
            else:
                seen = self._compiled("read", steps.read_jit, state, steps=1)(self.inputs, state)
                state, logits = forward(self.inputs, state, at)
                seen = {k: v[np.minimum(at, self.rows - 1)] for k, v in sharding.to_host(seen).items()
                        if k in steps.CAUGHT_UP}
            now = (np.asarray(seen["finish"]) == int(Finish.RUNNING)) & (np.asarray(at) < self.rows)
            running = now if running is None else running
            if not now.any() or (running & ~now).any():
                break
            self.constraints.catch_up(at, seen["tail"], seen["generated"], state)
            proposal, allowed = self.constraints.masks(at, proposal, candidates, spec.step_block)
            if proposal is not None:  # greedy rows' proposals rebuilt along their grammars
                given = given.replace(tokens=jax.device_put(proposal, given.tokens.sharding))
            if not spec.drafting:
                finish = finish or self._compiled("commit_rows", steps.commit_rows_jit, state, at, logits, allowed,
                                                  spec=spec)
                (state, seen), taken = finish(self.inputs, state, at, logits, allowed), taken + 1
                if taken < most:
                    state, logits = forward(self.inputs, state, at)
                continue
            run = self._compiled("step_rows", steps.step_rows_jit, state, at, given, allowed, spec=spec)
            (state, seen), taken = run(self.inputs, state, at, given, allowed), taken + 1
        return state, taken

    def _step_spec(self, bucket: int, block: int | None, max_steps: int):
        """(the spec of a run of ``bucket`` rows: verifying ``block`` tokens, else the policy's choice; its step
        limit, cut to ``EXPLORE_RUN_STEPS`` when the policy drafts only to learn)."""
        policy = self._chooser
        if block is None and policy is not None:
            block = policy.choose(bucket)
            if getattr(policy, "exploring", False):
                max_steps = min(max_steps, load_policy.EXPLORE_RUN_STEPS)
        spec = self.spec if block is None or block == self.spec.block_size else self.spec.at_block(block)
        if not spec.logprobs and any(self._logprobs.values()):  # one more program, only while such rows run
            spec = dataclasses.replace(spec, logprobs=True)
        return spec, np.int32(max_steps)

    def _ran(self, spec, taken: int) -> int:
        """``taken`` steps ran at ``spec``'s block: told to a policy that counts them."""
        if hasattr(self._chooser, "ran"):
            self._chooser.ran(spec.step_block, taken)
        return taken

    def block_table(self) -> dict:
        """Bucket of live rows -> the block its steps verify now (the policy's ``block_for``, else ``choose``; no
        policy: the block). Read from other threads (``/metrics``), so it changes no policy state of a
        ``BlockPolicy``."""
        policy = self._chooser
        if policy is None:
            return {b: self.spec.block_size for b in self.buckets()}
        read = getattr(policy, "block_for", policy.choose)
        return {b: read(b) for b in self.buckets()}

    def _reserve(self, state: DecodeState, preempt: bool = True) -> tuple[DecodeState, list[int]] | None:
        """Pages for the next ``LOOKAHEAD_STEPS`` steps (``LOOKAHEAD_PAGES`` pages at least) of every running row,
        oldest first; the newest rows are preempted while the pool cannot give them -> (state, the running rows).
        With launches not collected, from the last read's lengths plus what those may have written; a preemption
        needed then returns None (``preempt`` False)."""
        if self._unread and self._last_read is not None:
            finish, lengths = self._last_read
            lengths = np.asarray(lengths) + sum(self._unread)
        else:  # the state itself (waiting for what was launched)
            finish, lengths = self._seen or sharding.to_host((state.finish, state.tcache.lengths))
            if not self._unread:  # the base of the launches that follow
                self._last_read = (finish, lengths)
        running = sorted((r for r in np.flatnonzero(np.asarray(finish) == int(Finish.RUNNING)).tolist()
                          if r in self._order), key=self._order.get)  # a read before a release still shows its rows
        ahead = max(LOOKAHEAD_STEPS * self.spec.max_block, LOOKAHEAD_PAGES * self.spec.page)
        i = 0
        while i < len(running):
            r = running[i]
            want = min(int(lengths[r]) + ahead, self._need[r])
            if self.pool.grow(r, want):
                i += 1
                continue
            if not preempt:
                return None
            state = self._preempt(state, running.pop())  # the newest (perhaps r itself)
        return state, running

    def _preempt(self, state: DecodeState, row: int) -> DecodeState:
        """Free ``row``'s pages and slot, keeping what it needs to continue (``take_preempted``)."""
        at = np.asarray([row], np.int32)
        saved = sharding.to_host({f: getattr(state, f)[at] for f in steps.RESUMED})
        self._preempted.append((row, Resumed(self._requests[row], {f: v[0] for f, v in saved.items()})))
        self._admitted_at.pop(row, None)
        self._forget(row)
        return self._compiled("release", steps.release_jit, state, at)(self.inputs, state, at)

    def _forget(self, row: int) -> None:
        """Row ``row`` holds no request: its pages back to the pool."""
        if self.paged:
            self.pool.release(row)
        for d in (self._need, self._order, self._requests, self._cached, self._logprobs):
            d.pop(row, None)
        self.constraints.forget(row)

    def _tables(self, state: DecodeState) -> DecodeState:
        """The state's block tables set to the pool's (the host's allocation), when it changed."""
        if self._placed == self.pool.version:
            return state
        self._placed = self.pool.version
        return state.replace(pages=jax.device_put(self.pool.table, state.pages.sharding))

    def take_preempted(self) -> list[tuple[int, Resumed]]:
        """The rows preempted since the last call, each with what re-admits it (``admit`` a ``Resumed``: its
        output is unchanged), oldest preemption first; the caller queues them ahead of new requests."""
        out, self._preempted = self._preempted, []
        return out

    def progress(self, state: DecodeState, steps_taken: int = 1) -> dict:
        """Every row's counters on the host (``generated``, ``finish``, ``steps``, ``acceptance`` of its last step,
        ``acceptances`` [S, n] of its last n = ``steps_taken`` steps) and ``tail`` [S, W]: its last W tokens, ending
        at its newest committed one (W = n x max block + 1, the most an admission and n steps commit), so that a
        host streaming after every ``run(state, n)`` reads each row's new tokens without copying its token row.
        ``steps_taken`` is rounded up to a power of two (one program each), at most ``PROGRESS_STEPS``."""
        out = sharding.to_host(self._read(state, steps_taken))
        self._seen = (out["finish"], out.pop("lengths"))  # the next run's page check reads these
        return out

    def _read(self, state: DecodeState, steps_taken: int) -> dict:
        """``progress``'s program dispatched (device arrays): one per power of two of steps, up to ``PROGRESS_STEPS``."""
        n = max(int(steps_taken), 1)
        if n > PROGRESS_STEPS:
            raise ValueError(f"progress reads at most {PROGRESS_STEPS} steps back, asked {n}")
        return self._compiled("read", steps.read_jit, state, steps=1 << (n - 1).bit_length())(self.inputs, state)

    def cached(self, row: int) -> int:
        """The prompt tokens of the request in ``row`` that its admission read from cached pages (prefix caching)."""
        return self._cached.get(int(row), 0)

    def release(self, state: DecodeState, rows: Sequence[int]) -> tuple[DecodeState, list[GenerationResult]]:
        """The results of ``rows`` (timed from their admission by this engine) -> (state with them free, results)."""
        rows = [int(r) for r in rows]
        if not rows:
            return state, []
        self._seen = None
        at = np.zeros((min(1 << (len(rows) - 1).bit_length(), self.rows),), np.int32)  # a few gather shapes
        at[:len(rows)] = rows
        logprobs = any(self._logprobs.get(r, False) for r in rows)
        taken = self._compiled("take", steps.take_jit, state, at, logprobs=logprobs)(self.inputs, state, at)
        free = np.full((self.rows,), self.rows, np.int32)  # one program: padding indices past the state are dropped
        free[:len(rows)] = rows
        # the rows freed before their results are read: the two programs run back to back (the device orders the
        # release after the take that reads the state it donates)
        state = self._compiled("release", steps.release_jit, state, free)(self.inputs, state, free)
        host = sharding.to_host(taken)
        now = time.perf_counter()
        results = [row_result(host, j, int(host["prompt_length"][j]), now - self._admitted_at.pop(r, now),
                              self._logprobs.get(r, False), cached_tokens=self.cached(r))
                   for j, r in enumerate(rows)]
        for r in rows:
            self._forget(r)
        if self._chooser is not None:
            self._chooser.observe(results)
        return state, results


@dataclasses.dataclass
class RunStats:
    """What a continuous run did: loop steps, verify steps of every row, slot occupancy, the programs its engine
    ran (admit per group size and prompt bucket, run; each compiled once per process), its wall time and the part
    of it spent admitting (every prefill, waited for: wall_time_s - admit_time_s is the decoding's)."""

    loop_steps: int = 0
    row_steps: int = 0
    preemptions: int = 0  # rows preempted (their pages needed) and admitted again
    slots: int = 0
    programs: int = 0
    wall_time_s: float = 0.0
    admit_time_s: float = 0.0
    blocks: dict = dataclasses.field(default_factory=dict)  # a block policy's bucket -> block at the end

    @property
    def occupancy(self) -> float:
        """Mean fraction of the slots running a request per loop step."""
        return self.row_steps / max(self.loop_steps * self.slots, 1)


POLICIES = ("continuous", "static")


def row_buckets(rows: int) -> list[int]:
    """The live-row counts a paged engine of ``rows`` rows compiles its runs for: powers of two up to the rows (and
    the rows)."""
    return sorted({min(1 << i, rows) for i in range(rows.bit_length() + 1)})


def default_page(mesh=None) -> int:
    """Tokens per page where ``Engine`` is given none: ``CPU_PAGE`` on CPU, ``PAGE`` on TPU / GPU (the platform of
    ``mesh``'s devices, the params' mesh, when there is one)."""
    return CPU_PAGE if tiling.platform(mesh) == "cpu" else PAGE


def stream_requests(engine: Engine, requests: Iterable[Request], stats: RunStats | None = None,
                    policy: str = "continuous") -> Iterator[tuple[int, GenerationResult]]:
    """(index, result) of every request of ``requests`` (any iterable, read as slots free up) as it finishes.
    ``policy`` "continuous": S rows kept busy, the next requests admitted whenever rows finish; "static": the next S
    admitted only when every row of the last batch is done (closed batches, the baseline of the comparison). A bad
    ``policy`` raises at the call, before any work."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return _stream(engine, requests, stats if stats is not None else RunStats(), policy)


def _stream(engine: Engine, requests: Iterable[Request], stats: RunStats,
            policy: str) -> Iterator[tuple[int, GenerationResult]]:
    """``stream_requests``' loop (its options checked)."""
    stats.slots = engine.rows
    start = time.perf_counter()
    pending = iter(enumerate(requests))
    state, active, queued = engine.empty(), {}, {}  # row -> request index; row -> its time in the queue
    resume: list[tuple[int, float, Resumed]] = []  # preempted: (index, its queue time, what re-admits it)
    held = None  # the next new request, read from ``requests`` but not admitted yet (the pool lacked its pages)
    exhausted = False
    while True:
        free = [r for r in range(engine.rows) if r not in active]
        batch = []  # (index, queued so far, request): the preempted first, then new ones while pages last
        if policy == "continuous" or not active:
            while len(batch) < len(free):
                if not resume and held is None:
                    nxt = next(pending, None)
                    if nxt is None:
                        exhausted = True
                        break
                    held = (nxt[0], None, nxt[1])
                item = resume[0] if resume else held
                if not engine.can_admit([r for _, _, r in batch] + [item[2]]):
                    break
                if resume:
                    resume.pop(0)
                else:
                    held = None
                batch.append(item)
        if batch:
            t = time.perf_counter()
            # waited for (the next run would wait for it on the device anyway): its time is the prefill's
            state, rows = jax.block_until_ready(engine.admit(state, [r for _, _, r in batch], free[:len(batch)]))
            stats.admit_time_s += time.perf_counter() - t
            for row, (index, waited, _) in zip(rows, batch):  # queued until its admission begins
                active[row], queued[row] = index, t - start if waited is None else waited
        if not active:
            if resume or not exhausted:  # nothing is left behind silently
                raise RuntimeError("requests are waiting but none can be admitted into an empty pool")
            break
        state, taken = engine.run(state)
        stats.loop_steps += taken
        for row, again in engine.take_preempted():
            stats.preemptions += 1
            resume.append((active.pop(row), queued.pop(row), again))
        done = engine.finished_rows(state)
        state, results = engine.release(state, done)
        for row, result in zip(done, results):
            stats.row_steps += len(result.acceptance_lengths)
            yield active.pop(row), dataclasses.replace(result, queue_time_s=queued.pop(row))
    stats.wall_time_s = time.perf_counter() - start
    stats.programs = sum(key[0] not in RESULT_PROGRAMS for key in engine.used)
    if engine._chooser is not None:
        stats.blocks = engine.block_table()


def _hit_tails(requests: Sequence[Request], page: int) -> list[int]:
    """The prompt tails a prefix-cache hit may prefill in a known workload: each prompt less its longest run of full
    leading pages that another prompt opens with too (none when no two prompts share a page)."""
    if not page:
        return []
    chains = [PagePool.chain(r.prompt_ids, page, (len(r.prompt_ids) - 1) // page) for r in requests]
    seen = collections.Counter(h for c in chains for h in set(c))
    return [len(r.prompt_ids) - page * sum(seen[h] > 1 for h in c) for r, c in zip(requests, chains)
            if c and seen[c[0]] > 1]


def continuous_generate(target: Target, draft, requests: Sequence[Request | Sequence[int]], *, max_batch: int,
                        max_new_tokens: int | None = None, stats: RunStats | None = None, warm: bool = True,
                        policy: str = "continuous", on_result=None, page: int | None = None,
                        kv_cache_memory: int | None = None, prefix_cache: bool = True, block_policy=None,
                        tokenizer=None, **options) -> list[GenerationResult]:
    """Decode ``requests`` (``Request``s, or prompts as lists of ids) through ``max_batch`` slots, continuously
    batched -> one ``GenerationResult`` per request, in input order. ``options``: ``DecodeOptions``' (the defaults a
    request's own settings override; ``max_new_tokens`` may be left out when every request sets its own). A plain
    prompt i samples with the key of (seed, i), as row i of ``speculative_generate`` does; the slots' cache holds
    the longest prompt + budget of the requests. ``warm``: compile and run every program once before the clock
    starts (``Engine.warm``), so that timings exclude compilation. ``policy``: ``stream_requests``'.
    ``on_result(index, result)``, if given, is called as each request finishes (a progress bar, early writes).
    ``page``, ``kv_cache_memory``, ``prefix_cache``, ``block_policy``: ``Engine``'s (paged caches; the pool's bytes;
    shared prompt prefixes; the block each bucket of live rows verifies: "auto" measures it in the warm-up, which
    ``warm=False`` leaves out, so the run verifies the block until a policy exists). ``tokenizer``: what requests
    with a grammar need (``Engine``'s)."""
    requests = [r if isinstance(r, Request) else Request(list(r), stream=i) for i, r in enumerate(requests)]
    if not requests:
        raise ValueError("requests must be a non-empty list")
    if max_new_tokens is None:
        missing = [i for i, r in enumerate(requests) if r.max_new_tokens is None]
        if missing:
            raise ValueError(f"request {missing[0]} has no max_new_tokens, and no default was given")
        max_new_tokens = max(r.max_new_tokens for r in requests)
    opts = DecodeOptions(max_new_tokens=max_new_tokens, **options)
    limit = opts.limit(target.config)
    settings = [r.settings(opts) for r in requests]
    lens = [len(r.prompt_ids) for r in requests]
    if min(lens) == 0:
        raise ValueError(f"prompt {lens.index(0)} is empty")
    budget = prepare.budgets(lens, settings, limit)
    engine = Engine(target, draft, opts, max_batch=max_batch, max_length=int(max(np.add(lens, budget))),
                    sampled=any(s.temperature > 0 for s in settings),
                    stop_width=prepare.stop_width(settings), page=page, kv_cache_memory=kv_cache_memory,
                    prefix_cache=prefix_cache, block_policy=block_policy, tokenizer=tokenizer)
    engine.check(requests)
    stream = stream_requests(engine, requests, stats, policy)  # checks the policy; its clock starts at the first row
    if warm:
        engine.warm(lens, most_rows=len(requests), tails=_hit_tails(requests, engine.spec.page))
    out: list = [None] * len(requests)
    for index, result in stream:
        out[index] = result
        if on_result is not None:
            on_result(index, result)
    return out
