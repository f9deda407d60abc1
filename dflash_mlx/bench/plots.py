"""PNG plots of a bench report (the ``plot`` extra): the speedup per dataset and variant with the
ideal outlined, the acceptance-length histogram, and decode tokens/s per variant."""

from pathlib import Path
from typing import Dict

from ..atomic import atomic_file
from ..errors import InputError
from .report import variant_name, variant_order

PLOT_FILES = ("speedup.png", "acceptance_histogram.png", "tokens_per_s.png")


def plots_available() -> bool:
    """Whether matplotlib can be imported."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend; InputError (naming the extra) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (atomically) and close a figure; returns ``path``."""
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        pyplot().close(fig)
    return path


def _bars(ax, groups, width, j, n, heights, **kw):
    """Bars of variant j of n at the group positions ``groups``."""
    ax.bar([g + (j - (n - 1) / 2) * width for g in groups], heights, width * 0.9, **kw)


def plot_speedup(report: dict, path: Path) -> Path:
    """Measured speedup per dataset, one bar per variant, the ideal outlined."""
    datasets = report["datasets"]
    sizes = sorted({d["block_size"] for ds in datasets for d in ds["dflash"]}, key=variant_order)
    fig, ax = pyplot().subplots(figsize=(max(5.0, 1.6 * len(datasets) + 2), 3.4), dpi=100)
    width = 0.8 / max(len(sizes), 1)
    for j, B in enumerate(sizes):
        found = [(i, d) for i, ds in enumerate(datasets) for d in ds["dflash"] if d["block_size"] == B]
        groups = [i for i, _ in found]
        _bars(ax, groups, width, j, len(sizes), [d["speedup_median_of_ratios"] or 0.0 for _, d in found],
              label=f"{variant_name(B)} measured")
        _bars(ax, groups, width, j, len(sizes), [d["ideal_speedup"] or 0.0 for _, d in found], fill=False,
              edgecolor="black", linewidth=0.8, label="ideal" if j == 0 else None)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(datasets)), [ds["name"] for ds in datasets])
    ax.set(ylabel=f"speedup over {datasets[0]['baseline']['engine'] if datasets else 'baseline'}",
           title="DFlash speedup (median of per-pair ratios)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_acceptance(report: dict, path: Path) -> Path:
    """Per dataset, the share of verify steps at each acceptance length, one bar per variant."""
    datasets = report["datasets"]
    n = max(len(datasets), 1)
    fig, axes = pyplot().subplots(1, n, figsize=(3.4 * n, 3.0), dpi=100, squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for j, d in enumerate(ds["dflash"]):
            hist = {int(k): v for k, v in d["acceptance_histogram"].items()}
            lengths = range(1, max(hist, default=1) + 1)
            _bars(ax, lengths, 0.8 / max(len(ds["dflash"]), 1), j, len(ds["dflash"]),
                  [hist.get(k, 0) / (sum(hist.values()) or 1) for k in lengths],
                  label=f"{variant_name(d['block_size'])} (tau {d['tau'] or 0:.2f})")
        ax.set(title=ds["name"], xlabel="acceptance length (tokens per verify)", ylabel="share of steps")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_tokens_per_s(report: dict, path: Path) -> Path:
    """Decode tokens/s per variant, one line per dataset, the baseline dashed."""
    fig, ax = pyplot().subplots(figsize=(4.6, 3.2), dpi=100)
    for ds in report["datasets"]:
        sizes = [variant_name(d["block_size"]) for d in ds["dflash"]]
        line, = ax.plot(range(len(sizes)), [d["decode_tps_median"] or 0.0 for d in ds["dflash"]], marker="o",
                        label=f"{ds['name']} DFlash")
        ax.set_xticks(range(len(sizes)), sizes, fontsize=7)
        if ds["baseline"]["decode_tps_median"]:
            ax.axhline(ds["baseline"]["decode_tps_median"], color=line.get_color(), linestyle="--", linewidth=0.8,
                       label=f"{ds['name']} {ds['baseline']['engine']}")
    ax.set(xlabel="verify (block size B, auto, tree budget)", ylabel="decode tokens/s (median)",
           title="tokens/s vs block size")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_plots(report: dict, out_dir: str | Path) -> Dict[str, Path]:
    """Write the three PNGs into ``out_dir``; returns ``{name: path}``. InputError without matplotlib."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {"speedup": plot_speedup(report, out / PLOT_FILES[0]),
            "acceptance_histogram": plot_acceptance(report, out / PLOT_FILES[1]),
            "tokens_per_s": plot_tokens_per_s(report, out / PLOT_FILES[2])}
