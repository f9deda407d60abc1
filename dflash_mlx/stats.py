"""Decoding statistics: the only place tau, acceptance and rates are computed.

``generate``, ``chat``, ``bench`` and the session all read them from here.

- A verify step that accepts ``a`` of its ``B - 1`` drafts commits ``a + 1`` tokens:
  its **acceptance length** is ``a + 1`` (spec section 5).
- **tau** is the mean acceptance length over verify steps.
- The **acceptance rate** is accepted drafts over drafted tokens, summed over steps,
  so it stays right when the block size changes between steps or turns.
- The **histogram** counts steps by acceptance length (1..B).
- **Bandwidth** is the weight bytes read per second, as gpt-fast prints it: the
  bytes of the target and drafter weights times target forwards (verify steps) per
  second of decoding.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PHASES = ("prefill", "draft", "verify", "host")


@dataclass
class GenerationStats:
    """Counters and timings of one generation (or several, see :meth:`add`).

    Attributes:
        block_size: B of this run (1 for plain decoding); the trained B for totals.
        prompt_tokens: tokens prefilled.
        generation_tokens: tokens emitted (stop tokens excluded).
        steps: verify steps (target forwards after prefill that checked drafts).
        drafted: drafts proposed, summed over steps (B-1 per step at block size B).
        accepted: drafts accepted, summed over steps.
        histogram: ``{acceptance length: steps}``.
        phase_s: seconds the generator spent in each phase (prefill, draft, verify,
            host = acceptance, rollback and bookkeeping); in plain decoding
            "verify" is the 1-token target step.
        prompt_s: seconds to the first token (prefill and first sample).
        generation_s: seconds from the first token to the last.
        peak_memory_gb: ``mx.get_peak_memory()`` in GB (1e9 bytes).
        model_bytes: bytes of the weights read per step (target + drafter), for
            :attr:`bandwidth_gbps`; 0 when unknown.
        speculative: whether speculative decoding ran.
        reason: why it did not (None when it ran), e.g. "no drafter was given".
        block_attention: which path computed the drafter's block attention and why,
            ``{"block_attention": "metal" | "reference", "reason": str}`` (from
            :func:`dflash_mlx.kernels.block_attention.attention_path`); None without
            a drafter.
    """

    block_size: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: Dict[int, int] = field(default_factory=dict)
    phase_s: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    prompt_s: float = 0.0
    generation_s: float = 0.0
    peak_memory_gb: float = 0.0
    model_bytes: int = 0
    speculative: bool = True
    reason: Optional[str] = None
    block_attention: Optional[Dict[str, str]] = None

    def record_step(self, accepted: int, drafted: Optional[int] = None) -> None:
        """Count one verify step that accepted ``accepted`` of ``drafted`` drafts
        (default ``block_size - 1``)."""
        self.steps += 1
        self.accepted += accepted
        self.drafted += self.block_size - 1 if drafted is None else drafted
        self.histogram[accepted + 1] = self.histogram.get(accepted + 1, 0) + 1

    def add(self, other: "GenerationStats") -> None:
        """Accumulate another generation's counts and times (a chat's turns, a
        benchmark's runs). Peak memory is the larger of the two."""
        self.prompt_tokens += other.prompt_tokens
        self.generation_tokens += other.generation_tokens
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        for k, n in other.histogram.items():
            self.histogram[k] = self.histogram.get(k, 0) + n
        for p, s in other.phase_s.items():
            self.phase_s[p] = self.phase_s.get(p, 0.0) + s
        self.prompt_s += other.prompt_s
        self.generation_s += other.generation_s
        self.peak_memory_gb = max(self.peak_memory_gb, other.peak_memory_gb)
        self.model_bytes = max(self.model_bytes, other.model_bytes)

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
        """Mean acceptance length, tokens per verify step; 0.0 when no verify step ran."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens, 0..1; 0.0 when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second of prefill."""
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second, from the first token to the last."""
        return self.generation_tokens / self.generation_s if self.generation_s else 0.0

    @property
    def bandwidth_gbps(self) -> float:
        """Weight bytes read per second of decoding, GB/s (see the module doc)."""
        return self.model_bytes * self.steps / self.generation_s / 1e9 if self.generation_s else 0.0

    def update_memory(self) -> None:
        self.peak_memory_gb = mx.get_peak_memory() / 1e9

    def timings_ms(self) -> Dict[str, float]:
        return {p: round(s * 1e3, 3) for p, s in self.phase_s.items()}

    def to_dict(self) -> dict:
        """The ``--json`` keys (counts in tokens, rates in tokens/s, memory in GB,
        bandwidth in GB/s, histogram keyed by acceptance length)."""
        return {
            "speculative": self.speculative,
            "reason": self.reason,
            "block_attention": self.block_attention,
            "tokens": self.generation_tokens,
            "tau": round(self.tau, 4),
            "steps": self.steps,
            "block_size": self.block_size,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_histogram": histogram_dict(self.histogram),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": round(self.prompt_tps, 3),
            "generation_tokens": self.generation_tokens,
            "generation_tps": round(self.generation_tps, 3),
            "peak_memory": round(self.peak_memory_gb, 3),
            "bandwidth_gbps": round(self.bandwidth_gbps, 3),
            "timings_ms": self.timings_ms(),
        }

    def acceptance_line(self) -> str:
        """``tau T tokens/step over N steps (X% of drafts accepted)``."""
        return (f"tau {self.tau:.2f} tokens/step over {self.steps} steps "
                f"({100 * self.acceptance_rate:.1f}% of drafts accepted)")

    def format_lines(self) -> List[str]:
        """mlx-lm's stats lines, then ``Acceptance:``, ``Histogram:`` and ``Timings:``."""
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
            f"Peak memory: {self.peak_memory_gb:.3f} GB",
        ]
        if not self.speculative:
            lines.append(f"Speculative decoding: off ({self.reason})")
        elif self.block_size > 1:
            lines.append(f"Acceptance: {self.acceptance_line()} at block size {self.block_size}")
            lines.append("Histogram: " + format_histogram(self.histogram))
        if self.block_attention:
            path = self.block_attention
            lines.append(f"Block attention: {path['block_attention']} ({path['reason']})")
        if self.model_bytes:
            lines.append(f"Bandwidth: {self.bandwidth_gbps:.2f} GB/s")
        ms = self.timings_ms()
        lines.append("Timings: " + ", ".join(f"{p} {ms[p]:.1f} ms" for p in PHASES))
        return lines


def pooled(stats: Iterable[GenerationStats], block_size: int = 1) -> GenerationStats:
    """The sum of several generations' statistics (see :meth:`GenerationStats.add`)."""
    total = GenerationStats(block_size=block_size)
    for s in stats:
        total.add(s)
    return total


def histogram_dict(histogram: Dict[int, int]) -> Dict[str, int]:
    """``{"acceptance length": steps}`` in increasing order, for JSON."""
    return {str(k): histogram[k] for k in sorted(histogram) if histogram[k]}


def format_histogram(histogram: Dict[int, int]) -> str:
    """``length:steps`` pairs by acceptance length, e.g. ``1:3 5:1 16:7``."""
    return " ".join(f"{k}:{n}" for k, n in sorted(histogram.items()) if n) or "(no steps)"


def weight_bytes(*modules) -> int:
    """Bytes of the modules' parameters (quantized weights counted as stored)."""
    return sum(v.nbytes for m in modules if m is not None for _, v in tree_flatten(m.parameters()))


def teacher_forced(right: np.ndarray) -> dict:
    """Acceptance implied by held-out drafts under teacher forcing (training evaluation).

    Args:
        right: [N, B-1] bool, block n's draft at position k (1..B-1) equals the
            true token.

    Returns:
        ``{"accuracy": [B-1] share right per position, "acceptance": [B-1] share of
        blocks whose drafts 1..k are all right (position k accepted), "tau": 1 +
        mean number of leading right drafts (the acceptance length), "blocks": N}``.
    """
    n = right.shape[0]
    if n == 0:
        width = right.shape[1] if right.ndim == 2 else 0
        return {"accuracy": [0.0] * width, "acceptance": [0.0] * width, "tau": 1.0, "blocks": 0}
    leading = np.cumprod(right, axis=1)
    return {"accuracy": right.mean(0).round(4).tolist(), "acceptance": leading.mean(0).round(4).tolist(),
            "tau": round(1 + leading.sum() / n, 4), "blocks": n}
