"""Decoding statistics: the only place tau, acceptance and rates are computed;
``generate``, ``chat``, ``bench`` and ``serve`` all read and print them from here.

- The first token comes from prefill; each later target forward is a step. A
  **verify step** checks drafts: accepting ``a`` of its ``B - 1`` drafts commits
  ``a + 1`` tokens, its **acceptance length** (spec section 5). A **plain step**
  checks none: every step without a drafter, those ``--block-size auto`` chose.
- **tau** is the mean acceptance length over verify steps only: None (said in
  words, never 0) when none ran; never shown without a drafter.
- The **acceptance rate** is accepted drafts over drafted tokens, summed over steps
  (right when the block size changes between steps or turns); the **histogram**
  counts verify steps by acceptance length (1..B).
- **Bandwidth**, as gpt-fast prints it: weight bytes read per second of decoding
  (target + drafter per verify step, target per plain step); None without a time.
- The **prompt** is the whole prompt: ``prompt_reused`` tokens came from the prompt
  cache, the rest were prefilled; its rate is over the prefilled ones.
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
        prompt_tokens: tokens of the whole prompt.
        prompt_reused: of those, tokens found in the prompt cache (not prefilled).
        generation_tokens: tokens emitted (stop tokens excluded).
        steps: verify steps (target forwards after prefill that checked drafts).
        drafted: drafts proposed, summed over steps (B-1 per step at block size B).
        accepted: drafts accepted, summed over steps.
        histogram: ``{acceptance length: steps}``.
        phase_s: seconds the generator spent in each phase (prefill, draft, verify,
            host = acceptance, rollback and bookkeeping); a plain step is "verify".
        prompt_s: seconds to the first token (prefill and first sample).
        generation_s: seconds from the first token to the last.
        peak_memory_gb: ``mx.get_peak_memory()`` in GB (1e9 bytes).
        target_bytes, drafter_bytes: weight bytes, for :attr:`bandwidth_gbps` (0: unknown).
        speculative: whether speculative decoding ran.
        reason: why it did not (None when it ran), e.g. "no drafter was given".
        drafter_format: the drafter's checkpoint format (``architectures[0]``, e.g.
            ``DFlash2DraftModel``); None without a drafter.
        acceptance_rule: ``greedy``, ``sample-and-match`` or ``speculative``
            (:mod:`dflash_mlx.decode.acceptance`); None without a drafter.
        verify: what verified the drafts and why (``{"block_size": B or "auto",
            "tree_budget": None, N or "auto", "reason": why a requested tree is off,
            or None}``, and with auto ``"calibration"``: ``"timed"`` now, ``"stored"``
            (kept on disk by an earlier process), ``"kept"`` (earlier in this
            process) or ``"fixed"`` (given timings)); None without a drafter.
        plain_steps: 1-token target steps after the first token (module doc).
        widths: ``{"plain": steps, "chain N": steps, "tree N": steps}``: the verifies chosen.
        mode_s: seconds spent per mode (``plain``, ``chain``, ``tree``), drafting included.
        calibration_s: seconds spent timing the widths for ``--block-size auto`` (the
            first generation of a process only); not counted in ``prompt_s``.
        host_s: seconds of host work in decode steps (see :attr:`host_ms_per_step`).
        trace: ``[[accepted, drafted], ...]`` per verify step, in order: the
            acceptance trace ``bench --simulate-acceptance FILE`` replays.
        block_attention: which path computed the drafter's block attention and why,
            ``{"block_attention": "metal" | "reference", "reason": str}`` (from
            :func:`dflash_mlx.kernels.block_attention.attention_path`); None without
            a drafter.
        distributed: ``{"ranks": n, "sharding": "tensor"}`` under ``mlx.launch``; None in one process.
    """

    block_size: int
    prompt_tokens: int = 0
    prompt_reused: int = 0
    generation_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: Dict[int, int] = field(default_factory=dict)
    phase_s: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    prompt_s: float = 0.0
    generation_s: float = 0.0
    peak_memory_gb: float = 0.0
    target_bytes: int = 0
    drafter_bytes: int = 0
    speculative: bool = True
    reason: Optional[str] = None
    drafter_format: Optional[str] = None
    acceptance_rule: Optional[str] = None
    block_attention: Optional[Dict[str, str]] = None
    verify: Optional[Dict[str, object]] = None
    plain_steps: int = 0
    widths: Dict[str, int] = field(default_factory=dict)
    mode_s: Dict[str, float] = field(default_factory=dict)
    calibration_s: float = 0.0
    draft_share: Optional[float] = None
    timed_drafts: int = 0
    host_s: float = 0.0
    trace: List[List[int]] = field(default_factory=list)
    distributed: Optional[Dict[str, object]] = None

    def record_step(self, accepted: int, drafted: Optional[int] = None) -> None:
        """Count one verify step that accepted ``accepted`` of ``drafted`` drafts
        (default ``block_size - 1``)."""
        drafted = self.block_size - 1 if drafted is None else drafted
        self.steps += 1
        self.accepted += accepted
        self.drafted += drafted
        if drafted:
            self.trace.append([accepted, drafted])
        self.histogram[accepted + 1] = self.histogram.get(accepted + 1, 0) + 1

    def record_plain(self, seconds: float = 0.0) -> None:
        """Count one plain step (see :attr:`plain_steps`) that took ``seconds``."""
        self.plain_steps += 1
        self.phase_s["verify"] += seconds

    def time_draft(self) -> bool:
        """Whether this speculative step should time its drafting on its own: the
        first and every 16th. Drafting and verifying are one graph (one sync) on the
        other steps, so their phase split follows the share measured here."""
        return (self.steps + self.plain_steps) % 16 == 0 or self.draft_share is None

    def record_plan(self, mode: str, width: int, seconds: float, accepted: int, drafted: int,
                    draft_s: Optional[float] = None, wait_s: float = 0.0) -> None:
        """Count one step of ``mode`` (``plain``, ``chain``, ``tree``) of ``width``
        (tokens, or tree nodes) that took ``seconds`` and accepted ``accepted`` of
        ``drafted`` drafts; ``draft_s``: its drafting seconds when timed on its own;
        ``wait_s``: the part of ``seconds`` the host waited for the device."""
        self.host_s += max(seconds - wait_s - (draft_s or 0.0), 0.0)
        key = "plain" if mode == "plain" else f"{mode} {width}"
        self.widths[key] = self.widths.get(key, 0) + 1
        self.mode_s[mode] = self.mode_s.get(mode, 0.0) + seconds
        if mode == "plain":
            self.record_plain(seconds)
            return
        self.record_step(accepted, drafted)
        if draft_s is not None and seconds > 0:
            self.timed_drafts += 1
            share = min(draft_s / seconds, 1.0)
            self.draft_share = share if self.draft_share is None else 0.8 * self.draft_share + 0.2 * share
        share = self.draft_share or 0.0
        self.phase_s["draft"] += share * seconds
        self.phase_s["verify"] += (1 - share) * seconds

    def add(self, other: "GenerationStats") -> None:
        """Accumulate another generation's counts and times (a chat's turns, a
        benchmark's runs). Peak memory is the larger of the two. The acceptance trace
        is not joined: it is one generation's (a server's totals would grow with every
        step it ever ran)."""
        self.prompt_tokens += other.prompt_tokens
        self.prompt_reused += other.prompt_reused
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
        self.target_bytes = max(self.target_bytes, other.target_bytes)
        self.drafter_bytes = max(self.drafter_bytes, other.drafter_bytes)
        self.plain_steps += other.plain_steps
        self.host_s += other.host_s
        for k, n in other.widths.items():
            self.widths[k] = self.widths.get(k, 0) + n
        for k, v in other.mode_s.items():
            self.mode_s[k] = self.mode_s.get(k, 0.0) + v
        self.verify = self.verify or other.verify
        self.drafter_format = self.drafter_format or other.drafter_format
        self.acceptance_rule = self.acceptance_rule or other.acceptance_rule

    @contextmanager
    def host_work(self) -> Iterator[None]:
        """Add the wall time of the ``with`` body to :attr:`host_s`."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.host_s += time.perf_counter() - tic

    @property
    def host_ms_per_step(self) -> float:
        """Host work per decode step, ms: the Python thread building graphs,
        dispatching them, accepting and rolling back, and bookkeeping, outside its
        waits for the device (MLX's own dispatch inside ``mx.eval`` counts as waiting)."""
        n = self.steps + self.plain_steps
        return 1e3 * self.host_s / n if n else 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase_s[name]``."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] += time.perf_counter() - tic

    @property
    def tau(self) -> Optional[float]:
        """Mean acceptance length, tokens per verify step; None when no verify step ran."""
        return (self.accepted + self.steps) / self.steps if self.steps else None

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted drafts over drafted tokens, 0..1; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def prompt_prefilled(self) -> int:
        """Prompt tokens prefilled (not found in the prompt cache)."""
        return self.prompt_tokens - self.prompt_reused

    @property
    def prompt_tps(self) -> Optional[float]:
        """Prefilled prompt tokens per second of prefill; None when none was timed."""
        return self.prompt_prefilled / self.prompt_s if self.prompt_s and self.prompt_prefilled else None

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second, from the first token to the last."""
        return self.generation_tokens / self.generation_s if self.generation_s else 0.0

    @property
    def bandwidth_gbps(self) -> Optional[float]:
        """Weight bytes read per second of decoding, GB/s (see the module doc); None
        without a decoding time or weight sizes."""
        read = (self.target_bytes + self.drafter_bytes) * self.steps + self.target_bytes * self.plain_steps
        return read / self.generation_s / 1e9 if self.generation_s and read else None

    def update_memory(self) -> None:
        self.peak_memory_gb = mx.get_peak_memory() / 1e9

    def timings_ms(self) -> Dict[str, float]:
        return {p: round(s * 1e3, 3) for p, s in self.phase_s.items()}

    def to_dict(self, trace: bool = True) -> dict:
        """The ``--json`` keys (counts in tokens, rates in tokens/s, memory in GB, bandwidth
        in GB/s, histogram keyed by acceptance length; null: nothing to divide by);
        ``trace``: with ``acceptance_trace`` (per verify step; a server's usage has none)."""
        d = {
            "speculative": self.speculative,
            "reason": self.reason,
            "drafter_format": self.drafter_format,
            "acceptance_rule": self.acceptance_rule,
            "block_attention": self.block_attention,
            "verify": self.verify,
            "distributed": self.distributed,
            "widths": dict(sorted(self.widths.items())),
            "plain_steps": self.plain_steps,
            "mode_ms": {k: round(v * 1e3, 3) for k, v in sorted(self.mode_s.items())},
            "calibration_ms": round(self.calibration_s * 1e3, 3),
            "host_ms_per_step": round(self.host_ms_per_step, 4),
            "tokens": self.generation_tokens,
            "tau": _rounded(self.tau, 4),
            "steps": self.steps,
            "block_size": self.block_size,
            "acceptance_rate": _rounded(self.acceptance_rate, 4),
            "acceptance_histogram": histogram_dict(self.histogram),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_reused": self.prompt_reused,
            "prompt_tokens_prefilled": self.prompt_prefilled,
            "prompt_tps": _rounded(self.prompt_tps, 3),
            "generation_tokens": self.generation_tokens,
            "generation_tps": round(self.generation_tps, 3),
            "peak_memory": round(self.peak_memory_gb, 3),
            "bandwidth_gbps": _rounded(self.bandwidth_gbps, 3),
            "timings_ms": self.timings_ms(),
        }
        if trace:
            d["acceptance_trace"] = self.trace
        return d

    def prompt_line(self) -> str:
        """mlx-lm's ``Prompt: N tokens, X tokens-per-sec``; when the prompt cache held
        part of it, ``Prompt: N tokens (R reused from the prompt cache, P prefilled), X
        tokens-per-sec`` with X over the P prefilled tokens (no rate when none was timed)."""
        line = f"Prompt: {self.prompt_tokens} tokens"
        if self.prompt_reused:
            line += f" ({self.prompt_reused} reused from the prompt cache, {self.prompt_prefilled} prefilled)"
        tps = self.prompt_tps
        return line if tps is None else f"{line}, {tps:.3f} tokens-per-sec"

    def tau_text(self) -> Optional[str]:
        """The short form for one-line summaries: ``tau 2.31``, or ``no draft steps``;
        None without a drafter (no tau is shown then)."""
        if not self.speculative:
            return None
        return f"tau {self.tau:.2f}" if self.steps else "no draft steps"

    def acceptance_line(self) -> Optional[str]:
        """``tau T tokens/step over N verify steps (X% of drafts accepted)``, with
        ``, and P plain steps`` when ``--block-size auto`` took some; ``no draft steps:
        ...`` and why when no verify step ran; None without a drafter."""
        if not self.speculative:
            return None
        plain = f"{self.plain_steps} plain step" + ("s" if self.plain_steps != 1 else "")
        if self.steps:
            line = (f"tau {self.tau:.2f} tokens/step over {self.steps} verify steps "
                    f"({100 * self.acceptance_rate:.1f}% of drafts accepted)")
            return line + (f", and {plain}" if self.plain_steps else "")
        if self.plain_steps:
            return f"no draft steps: decoded plainly ({plain}) because block size auto expected that to be faster"
        return "no draft steps: the reply ended with its first token (from prefill)"

    def verify_line(self) -> str:
        """How the drafts were verified, e.g. ``auto: chain 16 x40, plain x12 (plain
        1.2 s, chain 3.4 s)``, and why a requested tree did not run."""
        v = self.verify or {}
        what = f"block size {v.get('block_size')}"
        if v.get("tree_budget") is not None:
            what += f", tree budget {v['tree_budget']}"
        if v.get("calibration"):
            what += f", calibration {v['calibration']}"
        used = ", ".join(f"{k} x{n}" for k, n in sorted(self.widths.items(), key=lambda kv: -kv[1]))
        spent = ", ".join(f"{k} {s:.2f} s" for k, s in sorted(self.mode_s.items()))
        line = f"{what}: {used or 'no steps'}" + (f" ({spent})" if spent else "")
        if v.get("reason"):
            line += f"; tree off: {v['reason']}"
        return line

    def format_lines(self) -> List[str]:
        """mlx-lm's stats lines, then ``Acceptance:``, ``Histogram:`` and ``Timings:``."""
        lines = [
            self.prompt_line(),
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
            f"Peak memory: {self.peak_memory_gb:.3f} GB",
        ]
        if not self.speculative:
            lines.append(f"Speculative decoding: off ({self.reason})")
        else:
            rule = f", {self.acceptance_rule}" if self.acceptance_rule else ""
            fmt = f" ({self.drafter_format}{rule})" if self.drafter_format else ""
            lines.append(f"Acceptance: {self.acceptance_line()}; block size {self.block_size}{fmt}")
            if self.steps:
                lines.append("Histogram: " + format_histogram(self.histogram))
        if self.speculative and self.verify is not None:
            lines.append("Verify: " + self.verify_line())
        if self.block_attention:
            path = self.block_attention
            lines.append(f"Block attention: {path['block_attention']} ({path['reason']})")
        if self.bandwidth_gbps is not None:
            lines.append(f"Bandwidth: {self.bandwidth_gbps:.2f} GB/s")
        ms = self.timings_ms()
        lines.append("Timings: " + ", ".join(f"{p} {ms[p]:.1f} ms" for p in PHASES))
        return lines


def _rounded(x: Optional[float], digits: int) -> Optional[float]:
    return None if x is None else round(x, digits)


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
