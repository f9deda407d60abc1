"""``GET /metrics``: Prometheus counters and gauges; pooled statistics come from :mod:`dflash_mlx.stats`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..stats import GenerationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own; ``totals`` pools every
    generation's statistics (``block_size``: the drafter's trained one, 1 without)."""

    def __init__(self, block_size: int = 1):
        self.registry = r = CollectorRegistry()
        self.totals = GenerationStats(block_size=block_size)
        self.requests = Counter(
            "dflash_requests", "Generation requests by endpoint and outcome (completed, cancelled: "
            "the client went away, rejected: queue full, invalid: a 4xx, timeout: past --request-timeout, "
            "error: a server error).",
            ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(
            "dflash_prompt_tokens", "Prompt tokens of generations, by source: reused from the "
            "caches or prefilled.", ["source"], registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated.", registry=r)
        self.steps = Counter("dflash_verify_steps", "Verify steps (target forwards that checked drafts).",
                             registry=r)
        self.acceptance = Counter("dflash_acceptance_length_steps",
                                  "Verify steps by acceptance length (tokens committed by the step).",
                                  ["length"], registry=r)
        self.tau = Gauge("dflash_tau", "Mean acceptance length over every verify step so far "
                         "(tokens per step).", registry=r)
        self.acceptance_rate = Gauge("dflash_acceptance_rate", "Accepted drafts over drafted tokens, "
                                     "every generation so far (0..1).", registry=r)
        self.tokens_per_second = Gauge("dflash_generation_tokens_per_second", "Tokens generated per "
                                       "second of generation, every generation so far.", registry=r)
        self.latency = Histogram("dflash_request_seconds", "Seconds from a request's arrival at the "
                                 "engine to its last token (waiting included).", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.queue = Gauge("dflash_queue_requests", "Requests running or waiting for the engine.",
                           registry=r)
        self.batching = Gauge("dflash_batching", "1 when requests decode together (--max-batch > 1 and a "
                              "target the batch path can run exactly), 0 when they run one at a time.",
                              registry=r)
        self.batch_size = Gauge("dflash_batch_size", "Sequences decoding together (after the last decode "
                                "step; 0 once the batch has emptied).",
                                registry=r)
        self.queue_wait = Histogram("dflash_queue_wait_seconds", "Seconds from a request's arrival at the "
                                    "engine to the start of its prefill.", buckets=LATENCY_BUCKETS, registry=r)
        self.request_tau = Histogram("dflash_request_tau", "Each finished request's mean acceptance length "
                                     "(tokens per verify step).", buckets=TAU_BUCKETS, registry=r)

    def request(self, endpoint: str, outcome: str) -> None:
        """Count one request by its outcome."""
        self.requests.labels(endpoint, outcome).inc()

    def generation(self, stats: GenerationStats, prompt_tokens: int, reused: int, seconds: float) -> None:
        """Count one generation: its prompt tokens (``reused`` of them from the caches) and the
        ``seconds`` from arrival at the engine to its last token."""
        self.totals.add(stats)
        self.prompt_tokens.labels("reused").inc(reused)
        self.prompt_tokens.labels("prefilled").inc(prompt_tokens - reused)
        self.generation_tokens.inc(stats.generation_tokens)
        self.steps.inc(stats.steps)
        for length, n in stats.histogram.items():
            self.acceptance.labels(str(length)).inc(n)
        if self.totals.steps:
            self.tau.set(self.totals.tau)
            self.acceptance_rate.set(self.totals.acceptance_rate)
        self.tokens_per_second.set(self.totals.generation_tps)
        self.latency.observe(seconds)
        if stats.steps:
            self.request_tau.observe(stats.tau)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
