"""PNG plots of a bench report, made with matplotlib (the ``plot`` extra).

Three figures, each from the ``results.json`` object of :mod:`.report`:

- ``speedup.png``: speedup over the baseline per dataset and block size (median of
  per-pair ratios), with the ideal speedup as an outline;
- ``acceptance_histogram.png``: share of verify steps by acceptance length, per
  dataset and block size;
- ``tokens_per_s.png``: decode tokens/s against block size per dataset, the
  baseline as a dashed line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from ..atomic import atomic_file
from ..errors import InputError
from .report import variant_name, variant_order

PLOT_FILES = ("speedup.png", "acceptance_histogram.png", "tokens_per_s.png")


def plots_available() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra is installed)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib() -> None:
    """Raises InputError (naming the extra and --no-plots) when matplotlib is missing."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'dflash-mlx[plot]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(report: dict, path: Path) -> Path:
    """Grouped bars: measured speedup per dataset (one bar per block size), ideal outlined."""
    plt = _pyplot()
    datasets = report["datasets"]
    sizes = sorted({d["block_size"] for ds in datasets for d in ds["dflash"]}, key=variant_order)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(datasets) + 2), 3.4), dpi=100)
    width = 0.8 / max(len(sizes), 1)
    for j, B in enumerate(sizes):
        xs, measured, ideal = [], [], []
        for i, ds in enumerate(datasets):
            d = next((d for d in ds["dflash"] if d["block_size"] == B), None)
            if d is None:
                continue
            xs.append(i + (j - (len(sizes) - 1) / 2) * width)
            measured.append(d["speedup_median_of_ratios"] or 0.0)
            ideal.append(d["ideal_speedup"] or 0.0)
        ax.bar(xs, measured, width * 0.9, label=f"{variant_name(B)} measured")
        ax.bar(xs, ideal, width * 0.9, fill=False, edgecolor="black", linewidth=0.8,
               label="ideal" if j == 0 else None)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels([ds["name"] for ds in datasets])
    baseline = datasets[0]["baseline"]["engine"] if datasets else "baseline"
    ax.set_ylabel(f"speedup over {baseline}")
    ax.set_title("DFlash speedup (median of per-pair ratios)", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write and close a figure; returns ``path``."""
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        _pyplot().close(fig)
    return path


def plot_acceptance(report: dict, path: Path) -> Path:
    """Bars of the share of verify steps at each acceptance length (1..B)."""
    plt = _pyplot()
    datasets = report["datasets"]
    fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(3.4 * max(len(datasets), 1), 3.0),
                             dpi=100, squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        n = len(ds["dflash"])
        width = 0.8 / max(n, 1)
        for j, d in enumerate(ds["dflash"]):
            hist = {int(k): v for k, v in d["acceptance_histogram"].items()}
            steps = sum(hist.values()) or 1
            lengths = range(1, max(hist, default=1) + 1)
            xs = [k + (j - (n - 1) / 2) * width for k in lengths]
            ax.bar(xs, [hist.get(k, 0) / steps for k in lengths], width * 0.9,
                   label=f"{variant_name(d['block_size'])} (tau {d['tau'] or 0:.2f})")
        ax.set_title(ds["name"])
        ax.set_xlabel("acceptance length (tokens per verify)")
        ax.set_ylabel("share of steps")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_tokens_per_s(report: dict, path: Path) -> Path:
    """Decode tokens/s against block size, one line per dataset; baseline dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 3.2), dpi=100)
    for ds in report["datasets"]:
        sizes = [variant_name(d["block_size"]) for d in ds["dflash"]]
        tps = [d["decode_tps_median"] or 0.0 for d in ds["dflash"]]
        line, = ax.plot(range(len(sizes)), tps, marker="o", label=f"{ds['name']} DFlash")
        ax.set_xticks(range(len(sizes)), sizes, fontsize=7)
        base = ds["baseline"]["decode_tps_median"]
        if base:
            ax.axhline(base, color=line.get_color(), linestyle="--", linewidth=0.8,
                       label=f"{ds['name']} {ds['baseline']['engine']}")
    ax.set_xlabel("verify (block size B, auto, tree budget)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("tokens/s vs block size")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_plots(report: dict, out_dir: str | Path) -> Dict[str, Path]:
    """Write the three PNGs into ``out_dir``; returns ``{name: path}``.

    Raises:
        InputError: matplotlib is not installed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "speedup": plot_speedup(report, out / PLOT_FILES[0]),
        "acceptance_histogram": plot_acceptance(report, out / PLOT_FILES[1]),
        "tokens_per_s": plot_tokens_per_s(report, out / PLOT_FILES[2]),
    }


__all__: List[str] = [
    "PLOT_FILES", "plot_speedup", "plot_acceptance", "plot_tokens_per_s", "require_matplotlib", "write_plots",
]
