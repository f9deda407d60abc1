"""Digest bench runs: medians, speedups, the ideal speedup, JSON and a Rich table.

Definitions (per dataset and block size B); tau, the acceptance rate and the
acceptance-length histogram come from :mod:`dflash_mlx.stats`, pooled over runs:

- ``decode_tps``: decode tokens per second of one run (see ``runner``); reported
  as the median over runs.
- speedup, two ways: the ratio of the medians, ``median(dflash tps) /
  median(baseline tps)``, and the median of the per-pair ratios (each DFlash run
  over the baseline run it was paired with, back to back).
- per-cycle times (ms): the engine's draft, verify and host phase seconds over
  verify steps; ``other`` is the rest of the decode wall time per cycle (the
  generator's own bookkeeping and the consumer).
- ideal speedup of a pair: ``tau x t_AR / (t_draft + t_verify)``, with ``t_AR``
  the baseline's decode seconds per token, ``t_draft + t_verify`` DFlash's
  per-cycle draft and verify seconds and tau taken as the decode tokens per verify
  step (``tokens_per_step``: equal to tau except that a last block cut at max
  tokens counts only what it emitted). ``measured_over_ideal`` is the median over
  pairs of measured/ideal, which is then exactly the share of DFlash's decode time
  spent in draft and verify: 1.0 means no loop overhead at all, 0.9 means 10%.
  ``ideal_speedup_at_tau`` uses the statistics' tau instead.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..atomic import atomic_file
from ..stats import GenerationStats, histogram_dict, pooled
from .runner import DatasetResult, RunRecord

SCHEMA = "dflash-bench/1"


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """Median of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def pooled_stats(runs: Sequence[RunRecord]) -> GenerationStats:
    """The runs' statistics summed (steps, acceptance, histogram, phases)."""
    return pooled((r.stats for r in runs), block_size=runs[0].stats.block_size if runs else 1)


def cycle_ms(run: RunRecord) -> Dict[str, Optional[float]]:
    """Milliseconds per target forward (a verify step, or a plain step ``--block-size
    auto`` chose): draft, verify, host and other (the rest of decode)."""
    if not run.forwards:
        return {k: None for k in ("draft", "verify", "host", "other")}
    ph = {k: run.stats.phase_s.get(k, 0.0) for k in ("draft", "verify", "host")}
    other = run.decode_s - sum(ph.values())
    return {**{k: 1e3 * v / run.forwards for k, v in ph.items()}, "other": 1e3 * other / run.forwards}


def seconds_per_token(run: RunRecord) -> Optional[float]:
    """Decode seconds per token (1 / decode_tps)."""
    tps = run.decode_tps
    return 1.0 / tps if tps else None


def tokens_per_step(run: RunRecord) -> Optional[float]:
    """Decode tokens per target forward (verify and plain steps): tau as the output
    sees it (the last block cut at max tokens or a stop token counts only the tokens
    it emitted; a plain step counts one)."""
    return run.decode_tokens / run.forwards if run.forwards else None


def ideal_speedup(run: RunRecord, base: RunRecord, tau: Optional[float] = None) -> Optional[float]:
    """``tau x t_AR / (t_draft + t_verify)`` for one DFlash run and its baseline run.

    Args:
        run, base: a DFlash run and the baseline run paired with it.
        tau: tokens per verify; default :func:`tokens_per_step`, so that
            measured/ideal is exactly the share of decode time spent drafting and
            verifying (the loop overhead is the rest).
    """
    t_ar = seconds_per_token(base)
    tau = tokens_per_step(run) if tau is None else tau
    if run.forwards == 0 or t_ar is None or not tau:
        return None
    phases = run.stats.phase_s
    cycle = (phases.get("draft", 0.0) + phases.get("verify", 0.0)) / run.forwards
    return tau * t_ar / cycle if cycle > 0 else None


def engine_summary(runs: Sequence[RunRecord]) -> dict:
    """Medians of one engine's runs (tokens/s, prompt tokens/s, GB, s/token) and
    their pooled acceptance."""
    stats = pooled_stats(runs)
    return {
        "engine": runs[0].engine if runs else None,
        "block_size": runs[0].block_size if runs else None,
        "runs": len(runs),
        "decode_tps_median": median(r.decode_tps for r in runs),
        "prompt_tps_median": median(r.prompt_tps for r in runs),
        "peak_memory_gb_max": max((r.peak_memory_gb for r in runs), default=None),
        "s_per_token_median": median(seconds_per_token(r) for r in runs),
        "generation_tokens_total": sum(r.generation_tokens for r in runs),
        "steps": stats.steps,
        "plain_steps": stats.plain_steps,
        "tau": stats.tau,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_histogram": histogram_dict(stats.histogram),
    }


def variant_order(b) -> tuple:
    """Fixed block sizes first (ascending), then auto, trees by budget, auto+tree."""
    if isinstance(b, int):
        return (0, b, "")
    if b == "auto":
        return (1, 0, "")
    return (2, int(b.split()[1]), "") if b.startswith("tree ") else (3, 0, b)


def variant_name(b) -> str:
    """``B=16``, ``auto``, ``tree 32``, ``auto+tree``."""
    return f"B={b}" if isinstance(b, int) else str(b)


def pairs(result: DatasetResult, block_size) -> List[tuple]:
    """(baseline run, DFlash run at B) pairs, matched by sample, turn and repeat."""
    base = {(r.sample, r.turn, r.repeat): r for r in result.runs if r.engine == result.baseline}
    out = []
    for r in result.runs:
        if r.engine == "dflash" and r.block_size == block_size:
            b = base.get((r.sample, r.turn, r.repeat))
            if b is not None:
                out.append((b, r))
    return out


def summarize(result: DatasetResult) -> dict:
    """Every reported figure of one dataset (see the module doc for definitions)."""
    base_runs = [r for r in result.runs if r.engine == result.baseline]
    base = engine_summary(base_runs)
    sizes = sorted({r.block_size for r in result.runs if r.engine == "dflash"}, key=variant_order)
    dflash = []
    for B in sizes:
        prs = pairs(result, B)
        runs = [r for _, r in prs]
        s = engine_summary(runs)
        measured = [ratio(r.decode_tps, b.decode_tps) for b, r in prs]
        ideal = [ideal_speedup(r, b) for b, r in prs]
        ideal_tau = [ideal_speedup(r, b, r.stats.tau) for b, r in prs]
        compared = [r.matches_baseline for r in runs if r.matches_baseline is not None]
        cycles = [cycle_ms(r) for r in runs]
        s.update({
            "speedup_ratio_of_medians": ratio(s["decode_tps_median"], base["decode_tps_median"]),
            "speedup_median_of_ratios": median(measured),
            "tokens_per_step": median(tokens_per_step(r) for r in runs),
            "ideal_speedup": median(ideal),
            "ideal_speedup_at_tau": median(ideal_tau),
            "measured_over_ideal": median(ratio(m, i) for m, i in zip(measured, ideal)),
            "cycle_ms": {k: median(c[k] for c in cycles) for k in ("draft", "verify", "host", "other")},
            "outputs_compared": len(compared),
            "outputs_differing": (len(compared) - sum(compared)) if compared else None,
        })
        dflash.append(s)
    return {
        "name": result.name,
        "num_samples": result.num_samples,
        "baseline": base,
        "dflash": dflash,
        "runs": [r.to_dict() for r in result.runs],
    }


def machine_info() -> dict:
    """Platform, versions and the load average when the report was written."""
    import mlx.core as mx

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        mlx_lm_version = None
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover
        load = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "device": str(mx.default_device()),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
    }


def build_report(results: Sequence[DatasetResult], config: dict, command: Sequence[str]) -> dict:
    """The ``results.json`` object: schema, command line, config, machine, datasets."""
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(command),
        "config": config,
        "machine": machine_info(),
        "datasets": [summarize(r) for r in results],
    }


def write_report(report: dict, out_dir: str | Path) -> Path:
    """Write ``DIR/results.json``; returns its path.

    Raises:
        WriteError: the folder or the file cannot be written (any errno).
    """
    path = Path(out_dir) / "results.json"
    with atomic_file(path, parents=True) as tmp:
        tmp.write_text(to_json(report) + "\n")
    return path


_NUMBER_LIST = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null|true|false)(?:,\s*(?:-?[\d.eE+-]+|null|true|false))*)\s*\]")


def to_json(report: dict) -> str:
    """Indented JSON with lists of numbers, and each per-run record, on one line."""
    runs = {}
    datasets = []
    for i, ds in enumerate(report.get("datasets", [])):
        keys = [f"@run-{i}-{j}@" for j in range(len(ds.get("runs", [])))]
        runs.update({k: json.dumps(r) for k, r in zip(keys, ds.get("runs", []))})
        datasets.append({**ds, "runs": keys} if "runs" in ds else ds)
    text = json.dumps({**report, "datasets": datasets} if "datasets" in report else report, indent=2)
    text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    return re.sub(r'"(@run-\d+-\d+@)"', lambda m: runs[m.group(1)], text)


def _f(value: Any, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def results_table(report: dict):
    """A Rich table: one row for each dataset's baseline and each DFlash block size."""
    from rich.table import Table

    table = Table(title="dflash bench: speed and acceptance")
    for col in ("dataset", "engine", "tau", "tok/s", "prompt tok/s", "peak GB", "speedup\n(med/med)",
                "speedup\n(med ratio)", "outputs\ndiffer"):
        table.add_column(col, justify="left" if col in ("dataset", "engine") else "right")
    for ds in report["datasets"]:
        b = ds["baseline"]
        table.add_row(ds["name"], f"{b['engine']} (baseline)", _f(b["tau"]) if b["engine"] == "draft-model" else "",
                      _f(b["decode_tps_median"], "{:.1f}"), _f(b["prompt_tps_median"], "{:.0f}"),
                      _f(b["peak_memory_gb_max"], "{:.3f}"), "1.00x", "1.00x", "")
        for d in ds["dflash"]:
            differ = d["outputs_differing"]
            table.add_row(
                "", f"dflash {variant_name(d['block_size'])}", _f(d["tau"]), _f(d["decode_tps_median"], "{:.1f}"),
                _f(d["prompt_tps_median"], "{:.0f}"), _f(d["peak_memory_gb_max"], "{:.3f}"),
                _f(d["speedup_ratio_of_medians"]) + "x", _f(d["speedup_median_of_ratios"]) + "x",
                "-" if differ is None else f"{differ}/{d['outputs_compared']}",
            )
    return table


def cycle_table(report: dict):
    """A Rich table of DFlash's time per verify cycle and the ideal vs measured speedup."""
    from rich.table import Table

    table = Table(title="time per verify cycle (ms, medians) and loop overhead")
    for col in ("dataset", "B", "draft", "verify", "host", "other", "t_AR/token", "tok/step", "ideal",
                "measured", "measured\n/ideal"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for ds in report["datasets"]:
        t_ar = ds["baseline"]["s_per_token_median"]
        for d in ds["dflash"]:
            c = d["cycle_ms"]
            phases = (_f(c[k], "{:.2f}") for k in ("draft", "verify", "host", "other"))
            table.add_row(ds["name"], str(d["block_size"]), *phases,
                          _f(None if t_ar is None else 1e3 * t_ar, "{:.2f}"), _f(d["tokens_per_step"]),
                          _f(d["ideal_speedup"]) + "x", _f(d["speedup_median_of_ratios"]) + "x",
                          _f(d["measured_over_ideal"], "{:.3f}"))
    return table


def histogram_lines(report: dict) -> List[str]:
    """One line per dataset and block size: the acceptance-length histogram (share of steps)."""
    lines = []
    for ds in report["datasets"]:
        for d in ds["dflash"]:
            steps = d["steps"] or 1
            bins = " ".join(f"{k}:{100 * n / steps:.0f}%" for k, n in d["acceptance_histogram"].items() if n)
            lines.append(f"{ds['name']} {variant_name(d['block_size'])}: acceptance length {bins or '(no steps)'}")
    return lines
