"""Digest bench runs into the ``results.json`` figures: per dataset and variant, pooled
acceptance, median tokens/s, the speedup (ratio of medians; median of per-pair ratios), milliseconds
per target forward by phase, and the ideal speedup ``tau x t_AR / (t_draft + t_verify)``."""

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from ..atomic import write_json
from ..stats import histogram_dict, pooled
from .runner import DatasetResult, RunRecord

SCHEMA = "dflash-bench/1"
PHASES = ("decode", "other")  # decode steps; the loop around them


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """Median of the values that are not None (None if none are)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def cycle_ms(run: RunRecord) -> Dict[str, Optional[float]]:
    """Milliseconds per target forward (verify or plain step) of each phase in ``PHASES``."""
    if not run.forwards:
        return {k: None for k in PHASES}
    ph = {"decode": run.stats.phase_s.get("decode", 0.0)}
    ph["other"] = run.decode_s - ph["decode"]
    return {k: 1e3 * v / run.forwards for k, v in ph.items()}


def seconds_per_token(run: RunRecord) -> Optional[float]:
    return 1.0 / run.decode_tps if run.decode_tps else None


def tokens_per_step(run: RunRecord) -> Optional[float]:
    """Decode tokens per target forward (verify or plain step)."""
    return run.decode_tokens / run.forwards if run.forwards else None


def ideal_speedup(run: RunRecord, base: RunRecord, tau: Optional[float] = None) -> Optional[float]:
    """``tau x t_AR / t_step`` of a DFlash run and its baseline run, t_step the mean decode step (tau:
    default :func:`tokens_per_step`, making measured/ideal the share of decode time inside the steps)."""
    tau = tokens_per_step(run) if tau is None else tau
    t_ar = seconds_per_token(base)
    if tau is None or t_ar is None or not run.forwards:
        return None
    cycle = run.stats.phase_s.get("decode", 0.0) / run.forwards
    return tau * t_ar / cycle if cycle > 0 else None


def engine_summary(runs: Sequence[RunRecord]) -> dict:
    """Medians of one engine's runs and their pooled acceptance."""
    stats = pooled((r.stats for r in runs), block_size=runs[0].stats.block_size if runs else 1)
    return {
        "engine": runs[0].engine if runs else None, "block_size": runs[0].block_size if runs else None,
        "runs": len(runs), "decode_tps_median": median(r.decode_tps for r in runs),
        "prompt_tps_median": median(r.prompt_tps for r in runs),
        "peak_memory_gb_max": max((r.peak_memory_gb for r in runs), default=None),
        "s_per_token_median": median(seconds_per_token(r) for r in runs),
        "generation_tokens_total": sum(len(r.tokens) for r in runs), "steps": stats.steps,
        "plain_steps": stats.plain_steps, "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
        "acceptance_histogram": histogram_dict(stats.histogram)}


def variant_order(b) -> tuple:
    """Fixed block sizes ascending, then auto, trees by budget, auto+tree."""
    if isinstance(b, int):
        return (0, b)
    if b == "auto":
        return (1, 0)
    return (2, int(b.split()[1])) if b.startswith("tree ") else (3, 0)


def variant_name(b) -> str:
    """``B=16``, ``auto``, ``tree 32``, ``auto+tree``."""
    return f"B={b}" if isinstance(b, int) else str(b)


def pairs(result: DatasetResult, block_size) -> List[tuple]:
    """(baseline run, DFlash run of this variant), matched by sample, turn and repeat."""
    base = {(r.sample, r.turn, r.repeat): r for r in result.runs if r.engine == result.baseline}
    return [(base[r.sample, r.turn, r.repeat], r) for r in result.runs
            if r.engine == "dflash" and r.block_size == block_size and (r.sample, r.turn, r.repeat) in base]


def variant_summary(result: DatasetResult, block_size, base: dict) -> dict:
    """:func:`engine_summary` of one variant plus its speedups, cycle times and output checks."""
    prs = pairs(result, block_size)
    runs = [r for _, r in prs]
    s = engine_summary(runs)
    measured = [ratio(r.decode_tps, b.decode_tps) for b, r in prs]
    ideal = [ideal_speedup(r, b) for b, r in prs]
    compared = [r.matches_baseline for r in runs if r.matches_baseline is not None]
    cycles = [cycle_ms(r) for r in runs]
    s.update({
        "speedup_ratio_of_medians": ratio(s["decode_tps_median"], base["decode_tps_median"]),
        "speedup_median_of_ratios": median(measured), "tokens_per_step": median(tokens_per_step(r) for r in runs),
        "ideal_speedup": median(ideal),
        "ideal_speedup_at_tau": median(ideal_speedup(r, b, r.stats.tau) for b, r in prs),
        "measured_over_ideal": median(ratio(m, i) for m, i in zip(measured, ideal)),
        "cycle_ms": {k: median(c[k] for c in cycles) for k in PHASES}, "outputs_compared": len(compared),
        "outputs_differing": (len(compared) - sum(compared)) if compared else None})
    return s


def summarize(result: DatasetResult) -> dict:
    """Every reported figure of one dataset."""
    base = engine_summary([r for r in result.runs if r.engine == result.baseline])
    sizes = sorted({r.block_size for r in result.runs if r.engine == "dflash"}, key=variant_order)
    return {"name": result.name, "num_samples": result.num_samples, "baseline": base,
            "dflash": [variant_summary(result, b, base) for b in sizes], "runs": [r.to_dict() for r in result.runs]}


def machine_info() -> dict:
    """Platform, versions and the load average."""
    import mlx.core as mx
    import mlx_lm

    return {
        "platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
        "mlx": mx.__version__, "mlx_lm": getattr(mlx_lm, "__version__", None), "device": str(mx.default_device()),
        "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", "")}


def build_report(results: Sequence[DatasetResult], config: dict, command: Sequence[str]) -> dict:
    """The ``results.json`` object: schema, command line, config, machine, datasets."""
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": list(command),
            "config": config, "machine": machine_info(), "datasets": [summarize(r) for r in results]}


def write_report(report: dict, out_dir: str | Path) -> Path:
    """Write ``DIR/results.json``; returns its path. Raises WriteError (any errno)."""
    path = Path(out_dir) / "results.json"
    write_json(path, report, indent=1, parents=True)
    return path
