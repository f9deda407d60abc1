"""Decoding statistics, the one place tau, acceptance and rates are computed (spec section 5).

The first token comes from prefill; each later target forward is a verify step (accepting ``a`` of its
``B - 1`` drafts commits ``a + 1`` tokens, its acceptance length) or a plain step (no drafts). tau is
the mean acceptance length over verify steps (None when none ran); the acceptance rate is accepted over
drafted tokens; bandwidth is weight bytes read per second of decoding."""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PHASES = ("prefill", "decode")  # a decode step drafts and verifies in one graph: one time
_SUMS = ("prompt_tokens", "prompt_reused", "generation_tokens", "steps", "drafted", "accepted", "prompt_s",
         "generation_s", "plain_steps", "probe_steps", "copied", "copies_accepted")


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1: ``1 token``, ``2 tokens``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


@dataclass
class GenerationStats:
    """Counters and timings of one generation (or several, see :meth:`add`).

    Attributes:
        block_size: B of this run (1 for plain decoding).
        prompt_tokens, prompt_reused: tokens of the whole prompt; of those, found in the prompt cache.
        generation_tokens: tokens emitted (stop tokens excluded).
        steps, drafted, accepted: verify steps; drafts proposed and accepted over them.
        histogram: ``{acceptance length: steps}``.
        phase_s: seconds per phase (:data:`PHASES`): prefill, and the decode steps (draft, verify,
            accept and roll back run as one graph, timed together).
        prompt_s, generation_s: seconds to the first token; from the first token to the last.
        peak_memory_gb: ``mx.get_peak_memory()`` in GB (1e9 bytes).
        target_bytes, drafter_bytes: weight bytes (0: unknown).
        speculative, reason: whether speculative decoding ran; why not (None when it ran).
        drafter_format, acceptance_rule: the drafter's ``architectures[0]`` and acceptance rule.
        verify: ``{"block_size": B or "auto", "tree_budget": None, N or "auto", "reason": why a requested
            tree is off, or None}``; None without a drafter.
        plain_steps, widths: plain steps; ``{"plain": steps, "chain N": steps, "tree N": steps}``.
        probe_steps: of all steps, those block size auto ran to measure an option other than its best.
        copied, copies_accepted: drafts copied from the context (prompt lookup) and those accepted.
        mode_s: seconds per mode (``plain``, ``chain``, ``tree``), drafting included.
        trace: ``[[accepted, drafted], ...]`` per verify step, in order.
        block_attention: ``{"block_attention": "metal" | "reference", "reason": str}``, or None.
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
    distributed: Optional[Dict[str, object]] = None
    verify: Optional[Dict[str, object]] = None
    plain_steps: int = 0
    probe_steps: int = 0
    copied: int = 0
    copies_accepted: int = 0
    widths: Dict[str, int] = field(default_factory=dict)
    mode_s: Dict[str, float] = field(default_factory=dict)
    trace: List[List[int]] = field(default_factory=list)

    def record_step(self, accepted: int, drafted: Optional[int] = None) -> None:
        """Count one verify step: ``accepted`` of ``drafted`` (default ``block_size - 1``) drafts."""
        drafted = self.block_size - 1 if drafted is None else drafted
        self.steps += 1
        self.accepted += accepted
        self.drafted += drafted
        if drafted:
            self.trace.append([accepted, drafted])
        self.histogram[accepted + 1] = self.histogram.get(accepted + 1, 0) + 1

    def record_plain(self, seconds: float = 0.0) -> None:
        """Count one plain step of ``seconds``."""
        self.plain_steps += 1
        self.phase_s["decode"] += seconds

    def record_plan(self, mode: str, width: int, seconds: float, accepted: int, drafted: int,
                    probe: bool = False) -> None:
        """Count one step of ``mode`` (``plain``, ``chain``, ``tree``) and ``width`` (tokens or nodes) of
        ``seconds`` (decode time); ``probe``: auto ran it to measure it. Without a drafter (not ``speculative``), a
        plain step counts by :meth:`record_plain` only."""
        if mode == "plain" and not self.speculative:
            return self.record_plain(seconds)
        self.probe_steps += probe
        key = "plain" if mode == "plain" else f"{mode} {width}"
        self.widths[key] = self.widths.get(key, 0) + 1
        self.mode_s[mode] = self.mode_s.get(mode, 0.0) + seconds
        if mode == "plain":
            self.record_plain(seconds)
            return
        if mode == "lookup":
            self.copied, self.copies_accepted = self.copied + drafted, self.copies_accepted + accepted
        self.record_step(accepted, drafted)
        self.phase_s["decode"] += seconds

    def add(self, other: "GenerationStats") -> None:
        """Accumulate another generation's counts and times; peak memory and weight bytes are the larger,
        the acceptance trace is not joined."""
        for name in _SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("peak_memory_gb", "target_bytes", "drafter_bytes"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        for name in ("histogram", "phase_s", "widths", "mode_s"):
            mine = getattr(self, name)
            for k, v in getattr(other, name).items():
                mine[k] = mine.get(k, 0) + v
        for name in ("verify", "drafter_format", "acceptance_rule"):
            setattr(self, name, getattr(self, name) or getattr(other, name))

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
        """Weight bytes read per second of decoding, GB/s; None without a time or weight sizes."""
        read = (self.target_bytes + self.drafter_bytes) * self.steps + self.target_bytes * self.plain_steps
        return read / self.generation_s / 1e9 if self.generation_s and read else None

    def committed(self, tokens: int, first: float, now: float, attention: Optional[dict] = None) -> None:
        """``tokens`` more generated, the first of all at ``first`` and these at ``now`` (``time.perf_counter``
        seconds): the count, the generation time, the peak memory and the block attention path that ran."""
        self.generation_tokens += tokens
        self.generation_s = now - first
        self.peak_memory_gb = mx.get_peak_memory() / 1e9
        self.block_attention = attention or self.block_attention

    def timings_ms(self) -> Dict[str, float]:
        return {p: round(s * 1e3, 3) for p, s in self.phase_s.items()}

    def to_dict(self, trace: bool = True) -> dict:
        """The ``--json`` keys (tokens, tokens/s, GB, GB/s, ms; null: nothing to divide by); ``trace``:
        with ``acceptance_trace``."""
        d = {
            "speculative": self.speculative, "reason": self.reason, "drafter_format": self.drafter_format,
            "acceptance_rule": self.acceptance_rule, "block_attention": self.block_attention,
            "distributed": self.distributed, "verify": self.verify, "widths": dict(sorted(self.widths.items())),
            "plain_steps": self.plain_steps, "probe_steps": self.probe_steps,
            "prompt_lookup": {"drafted": self.copied, "accepted": self.copies_accepted},
            "mode_ms": {k: round(v * 1e3, 3) for k, v in sorted(self.mode_s.items())},
            "tokens": self.generation_tokens, "tau": rounded(self.tau, 4), "steps": self.steps,
            "block_size": self.block_size, "acceptance_rate": rounded(self.acceptance_rate, 4),
            "acceptance_histogram": histogram_dict(self.histogram), "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_reused": self.prompt_reused, "prompt_tokens_prefilled": self.prompt_prefilled,
            "prompt_tps": rounded(self.prompt_tps, 3), "generation_tokens": self.generation_tokens,
            "generation_tps": round(self.generation_tps, 3), "peak_memory": round(self.peak_memory_gb, 3),
            "bandwidth_gbps": rounded(self.bandwidth_gbps, 3), "timings_ms": self.timings_ms()}
        if trace:
            d["acceptance_trace"] = self.trace
        return d

    def prompt_line(self) -> str:
        """``Prompt: N tokens[ (R reused from the prompt cache, P prefilled)][, X tokens-per-sec]``."""
        line = f"Prompt: {self.prompt_tokens} tokens"
        if self.prompt_reused:
            line += f" ({self.prompt_reused} reused from the prompt cache, {self.prompt_prefilled} prefilled)"
        tps = self.prompt_tps
        return line if tps is None else f"{line}, {tps:.3f} tokens-per-sec"

    def tau_text(self) -> Optional[str]:
        """``tau 2.31`` or ``no draft steps``; None without a drafter."""
        return (f"tau {self.tau:.2f}" if self.steps else "no draft steps") if self.speculative else None

    def acceptance_line(self) -> Optional[str]:
        """``tau T tokens/step over N verify steps (X% of drafts accepted)[, and P plain steps]``, or
        ``no draft steps: WHY``; None without a drafter."""
        if not self.speculative:
            return None
        plain = plural(self.plain_steps, "plain step")
        if self.steps:
            line = (f"tau {self.tau:.2f} tokens/step over {self.steps} verify steps "
                    f"({100 * self.acceptance_rate:.1f}% of drafts accepted)")
            return line + (f", and {plain}" if self.plain_steps else "")
        if self.plain_steps:
            return f"no draft steps: decoded plainly ({plain}) because block size auto expected that to be faster"
        return "no draft steps: the reply ended with its first token (from prefill)"

    def verify_line(self) -> str:
        """How the drafts were verified, e.g. ``block size auto: chain 16 x40, plain x12 (chain 3.40 s, plain
        1.20 s)``, and why a requested tree did not run."""
        v = self.verify or {}
        what = f"block size {v.get('block_size')}"
        if v.get("tree_budget") is not None:
            what += f", tree budget {v['tree_budget']}"
        used = ", ".join(f"{k} x{n}" for k, n in sorted(self.widths.items(), key=lambda kv: -kv[1]))
        spent = ", ".join(f"{k} {s:.2f} s" for k, s in sorted(self.mode_s.items()))
        line = f"{what}: {used or 'no steps'}" + (f" ({spent})" if spent else "")
        if self.probe_steps:
            line += f"; {plural(self.probe_steps, 'probe')} among them"
        if v.get("reason"):
            line += f"; tree off: {v['reason']}"
        return line

    def format_lines(self) -> List[str]:
        """mlx-lm's stats lines, then ``Acceptance:``, ``Histogram:`` and ``Timings:``."""
        lines = [self.prompt_line(), f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
                 f"Peak memory: {self.peak_memory_gb:.3f} GB"]
        if not self.speculative:
            lines.append(f"Speculative decoding: off ({self.reason})")
        else:
            rule = f", {self.acceptance_rule}" if self.acceptance_rule else ""
            fmt = f" ({self.drafter_format}{rule})" if self.drafter_format else ""
            auto = "auto (up to %d)" if (self.verify or {}).get("block_size") == "auto" else "%d"  # widths: Verify
            size = "block size " + auto % self.block_size
            lines.append(f"Acceptance: {self.acceptance_line()}; {size}{fmt}")
            if self.steps:
                lines.append("Histogram: " + format_histogram(self.histogram))
        if self.speculative and self.verify is not None:
            lines.append("Verify: " + self.verify_line())
        if self.copied:
            lines.append(f"Prompt lookup: {self.copies_accepted} of {self.copied} copied drafts accepted")
        if self.block_attention:
            path = self.block_attention
            lines.append(f"Block attention: {path['block_attention']} ({path['reason']})")
        if self.bandwidth_gbps is not None:
            lines.append(f"Bandwidth: {self.bandwidth_gbps:.2f} GB/s")
        ms = self.timings_ms()
        lines.append("Timings: " + ", ".join(f"{p} {ms[p]:.1f} ms" for p in PHASES))
        return lines


def rounded(x: Optional[float], digits: int = 6) -> Optional[float]:
    """``round(x, digits)``, None for None."""
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
    """Acceptance implied by held-out drafts under teacher forcing.

    Args:
        right: [N, B-1] bool, block n's draft at position k equals the true token.

    Returns:
        ``{"accuracy": [B-1] share right per position, "acceptance": [B-1] share of blocks whose drafts
        1..k are all right, "tau": 1 + mean leading right drafts, "blocks": N}``.
    """
    n = right.shape[0]
    if n == 0:
        width = right.shape[1] if right.ndim == 2 else 0
        return {"accuracy": [0.0] * width, "acceptance": [0.0] * width, "tau": 1.0, "blocks": 0}
    leading = np.cumprod(right, axis=1)
    return {"accuracy": right.mean(0).round(4).tolist(), "acceptance": leading.mean(0).round(4).tolist(),
            "tau": round(1 + leading.sum() / n, 4), "blocks": n}
