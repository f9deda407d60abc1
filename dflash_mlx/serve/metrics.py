"""``GET /metrics``: Prometheus counters and gauges; pooled statistics come from :mod:`dflash_mlx.stats`."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..stats import GenerationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


class ServerMetrics:
    """The server's Prometheus metrics in their own registry; ``totals`` pools every generation's statistics."""

    def __init__(self, block_size: int = 1):
        self.registry = r = CollectorRegistry()
        self.totals = GenerationStats(block_size=block_size)
        self.requests = Counter("dflash_requests", "Generation requests by endpoint and outcome (completed, cancelled, "
                                "rejected, invalid, timeout, error).", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens by source: reused or prefilled.",
                                     ["source"], registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated.", registry=r)
        self.steps = Counter("dflash_verify_steps", "Verify steps.", registry=r)
        self.acceptance = Counter("dflash_acceptance_length_steps", "Verify steps by tokens committed.",
                                  ["length"], registry=r)
        self.tau = Gauge("dflash_tau", "Mean acceptance length over every verify step so far.", registry=r)
        self.acceptance_rate = Gauge("dflash_acceptance_rate", "Accepted over drafted tokens so far.", registry=r)
        self.tokens_per_second = Gauge("dflash_generation_tokens_per_second", "Generation tokens per second so far.",
                                       registry=r)
        self.latency = Histogram("dflash_request_seconds", "Seconds from arrival at the engine to the last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("dflash_queue_requests", "Requests running or waiting.", registry=r)
        self.batching = Gauge("dflash_batching", "1 when requests decode together, 0 when one at a time.", registry=r)
        self.batch_size = Gauge("dflash_batch_size", "Sequences decoding together after the last step.", registry=r)
        self.queue_wait = Histogram("dflash_queue_wait_seconds", "Seconds from arrival at the engine to prefill.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.request_tau = Histogram("dflash_request_tau", "Each finished request's mean acceptance length.",
                                     buckets=TAU_BUCKETS, registry=r)

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def generation(self, stats: GenerationStats, prompt_tokens: int, reused: int, seconds: float) -> None:
        """Count one generation (``reused`` prompt tokens from the caches; ``seconds`` since arrival)."""
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
        return generate_latest(self.registry)
