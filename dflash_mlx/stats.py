"""Decoding statistics shared by ``generate``, ``chat`` and ``bench``.

Acceptance length tau is the mean over verify steps of ``accepted + 1`` (tokens
committed per target forward, spec section 5); the histogram counts how often each
accepted count ``0..B-1`` occurred.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

import mlx.core as mx

PHASES = ("prefill", "draft", "verify", "host")


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    Attributes:
        block_size: B used for this run (1 for plain decoding).
        prompt_tokens: tokens prefilled.
        generation_tokens: tokens emitted (stop tokens excluded).
        steps: verify steps (target forwards after prefill).
        histogram: ``histogram[a]`` = verify steps that accepted ``a`` drafts.
        phase_s: seconds the generator spent in each phase (prefill, draft, verify,
            host = acceptance, rollback and bookkeeping); the consumer's time is not
            counted. In plain decoding, "verify" is the 1-token target step.
        prompt_s: seconds to the first token (prefill and first sample).
        generation_s: seconds from the first token to the last.
        peak_memory_gb: ``mx.get_peak_memory()`` in GB (1e9 bytes).
    """

    block_size: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    histogram: List[int] = field(default_factory=list)
    phase_s: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    prompt_s: float = 0.0
    generation_s: float = 0.0
    peak_memory_gb: float = 0.0

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * max(self.block_size, 1)

    def record_step(self, accepted: int) -> None:
        """Count one verify step that accepted ``accepted`` drafts."""
        self.steps += 1
        self.histogram[accepted] += 1

    def add(self, other: "GenerationStats") -> None:
        """Accumulate another generation's counts and times (e.g. a chat's turns).

        Histograms of different block sizes are added bin by bin (accepted count a);
        peak memory is the larger of the two.
        """
        self.prompt_tokens += other.prompt_tokens
        self.generation_tokens += other.generation_tokens
        self.steps += other.steps
        self.histogram += [0] * (len(other.histogram) - len(self.histogram))
        for a, n in enumerate(other.histogram):
            self.histogram[a] += n
        for p, s in other.phase_s.items():
            self.phase_s[p] += s
        self.prompt_s += other.prompt_s
        self.generation_s += other.generation_s
        self.peak_memory_gb = max(self.peak_memory_gb, other.peak_memory_gb)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase_s[name]``."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] += time.perf_counter() - tic

    @property
    def tau(self) -> float:
        """Mean acceptance length, tokens per verify step (1.0 when none ran)."""
        if not self.steps:
            return 0.0
        return sum((a + 1) * n for a, n in enumerate(self.histogram)) / self.steps

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts, 0..1."""
        proposed = self.steps * (self.block_size - 1)
        accepted = sum(a * n for a, n in enumerate(self.histogram))
        return accepted / proposed if proposed else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_s if self.generation_s else 0.0

    def update_memory(self) -> None:
        self.peak_memory_gb = mx.get_peak_memory() / 1e9

    def timings_ms(self) -> Dict[str, float]:
        return {p: round(s * 1e3, 3) for p, s in self.phase_s.items()}

    def to_dict(self) -> dict:
        """The ``--json`` keys (counts in tokens, rates in tokens/s, memory in GB)."""
        return {
            "tokens": self.generation_tokens,
            "tau": round(self.tau, 4),
            "steps": self.steps,
            "block_size": self.block_size,
            "acceptance_histogram": list(self.histogram),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": round(self.prompt_tps, 3),
            "generation_tokens": self.generation_tokens,
            "generation_tps": round(self.generation_tps, 3),
            "peak_memory": round(self.peak_memory_gb, 3),
            "timings_ms": self.timings_ms(),
        }

    def format_lines(self) -> List[str]:
        """mlx-lm's stats lines, then ``Acceptance:``, ``Histogram:`` and ``Timings:``."""
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
            f"Peak memory: {self.peak_memory_gb:.3f} GB",
        ]
        if self.block_size > 1:
            lines.append(
                f"Acceptance: tau {self.tau:.2f} tokens/step over {self.steps} steps "
                f"(block size {self.block_size}, {100 * self.acceptance_rate:.1f}% of drafts accepted)"
            )
            lines.append("Histogram: " + format_histogram(self.histogram))
        ms = self.timings_ms()
        lines.append("Timings: " + ", ".join(f"{p} {ms[p]:.1f} ms" for p in PHASES))
        return lines


def format_histogram(histogram: List[int]) -> str:
    """``accepted:count`` pairs for the non-zero bins, e.g. ``0:3 4:1 15:7``."""
    return " ".join(f"{a}:{n}" for a, n in enumerate(histogram) if n) or "(no steps)"
