"""The server's Prometheus metrics (``GET /metrics``, the text exposition format), in a registry of its own so that
several servers in one process (tests, the serving benchmark) keep separate counts."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 (re-exported for the app)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Requests by endpoint and outcome, tokens in / out, queue depth, slot occupancy, acceptance lengths (a
    histogram and their running mean), time to first token, time per output token, queue time, latency."""

    def __init__(self, slots: int, max_block: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Requests answered, by endpoint and outcome (ok; cancelled: the "
                                "client went away; invalid: a field refused by validation; unsupported: a feature "
                                "not supported; not_found: an unknown model; too_large: the body over the limit; "
                                "overloaded: a full queue or a server shutting down; internal: a server failure)",
                                ["endpoint", "outcome"], registry=r)
        self.responses = Counter("dflash_http_responses", "HTTP responses by route (unknown routes: other) and "
                                 "status code", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("dflash_slots_busy", "Decode slots holding a request", registry=r)
        self.slots_total = Gauge("dflash_slots_total", "Decode slots (--max-batch)", registry=r)
        self.slots_total.set(slots)
        self.preemptions = Counter("dflash_preemptions", "Requests preempted (the cache pool ran dry: their pages "
                                   "freed, admitted again later where they stopped)", registry=r)
        self.pages_free = Gauge("dflash_cache_pages_free", "Pages of the paged K/V cache pool a request may take "
                                "(free, or cached and held by no request: evicted when taken)", registry=r)
        self.prefix_hits = Counter("dflash_prefix_cache_hits", "Finished requests whose prompt started with cached "
                                   "pages (a shared prefix: not prefilled again)", registry=r)
        self.cached_tokens = Counter("dflash_prefix_cache_tokens", "Prompt tokens read from cached pages instead of "
                                     "prefilled", registry=r)
        self.evictions = Gauge("dflash_prefix_cache_evictions", "Cached pages evicted (least recently used) for new "
                               "tokens since the start", registry=r)
        self.steps = Counter("dflash_engine_steps", "Decode steps of the engine (each drafts and verifies every "
                             "busy slot)", registry=r)
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per verify step of a request "
                                    "(the bonus token included)", buckets=tuple(range(1, max_block + 2)), registry=r)
        self.tau = Gauge("dflash_mean_acceptance_length", "Mean acceptance length over every verify step so far",
                         registry=r)
        self.tau.set_function(self._tau)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Request arrival until its first token left the "
                              "engine", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dflash_time_per_output_token_seconds", "Decode time per output token after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram("dflash_queue_time_seconds", "Request arrival until it took a slot",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("dflash_request_latency_seconds", "Request arrival until its last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        # vLLM's speculative-decoding counters, by its names (dashboards and scripts written for vLLM read them)
        self.vllm_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps of finished or cancelled "
                                   "requests (one draft each)", registry=r)
        self.vllm_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified (each step's "
                                         "verified length, the pending token left out)", registry=r)
        self.vllm_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted (the bonus "
                                     "token left out)", registry=r)
        self.vllm_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted at each draft position", ["position"], registry=r)
        self.block = Gauge("dflash_block_size", "Tokens each decode step verifies, by the bucket of live rows it "
                           "runs in (--block-size auto follows the load; 1: plain steps)", ["bucket"], registry=r)
        self._accepted = self._verify_steps = 0

    def follow_blocks(self, buckets, table) -> None:
        """``dflash_block_size`` of each bucket read from ``table()`` (bucket -> block) at every scrape."""
        for b in buckets:
            self.block.labels(str(b)).set_function(lambda b=b: table()[b])

    def _tau(self) -> float:
        return self._accepted / self._verify_steps if self._verify_steps else 0.0

    def step(self, acceptance_lengths, steps: int = 1) -> None:
        """``steps`` engine steps: the acceptance length of each verify step of a row in them."""
        self.steps.inc(steps)
        for a in acceptance_lengths:
            self.acceptance.observe(a)
            self._accepted += int(a)
            self._verify_steps += 1

    def drafts(self, acceptance_lengths, verify_lengths) -> None:
        """A request's verify steps, when it leaves its row: vLLM's counters (a step that verified v tokens, the
        pending one first, and committed a: v - 1 draft tokens, a - 1 of them accepted, positions 0..a-2)."""
        drafted = [(int(a), int(v)) for a, v in zip(acceptance_lengths, verify_lengths) if int(v) > 1]
        if not drafted:  # plain steps (the block policy's) drafted nothing
            return
        acceptance_lengths, verify_lengths = zip(*drafted)
        self.vllm_drafts.inc(len(acceptance_lengths))
        self.vllm_draft_tokens.inc(sum(max(int(v) - 1, 0) for v in verify_lengths))
        accepted = [max(int(a) - 1, 0) for a in acceptance_lengths]
        self.vllm_accepted.inc(sum(accepted))
        longest = max(accepted)
        for pos in range(longest):
            self.vllm_accepted_per_pos.labels(str(pos)).inc(sum(1 for a in accepted if a > pos))

    def text(self) -> bytes:
        return generate_latest(self.registry)
