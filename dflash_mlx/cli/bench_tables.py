"""The tables ``dflash bench`` prints from a bench report (:mod:`dflash_mlx.bench.report`)."""

from typing import Any, Iterable, List, Sequence

from rich.table import Table

from dflash_mlx.bench.report import PHASES, variant_name

# The columns each table leaves out first where a width is too narrow for all (cli.common.print_table's drop)
RESULTS_DROP = ("peak GB", "prompt tok/s")
CYCLE_DROP = ("t_AR/token", "tok/step")
AGENT_DROP = ("TTFT sum s", "total s", "prefilled", "req")

def cell(value: Any, fmt: str = "{:.2f}") -> str:
    """A table cell: ``value`` formatted with ``fmt``, or ``-`` for None (not measured)."""
    return "-" if value is None else fmt.format(value)


def _table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], left: int) -> Table:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def results_table(report: dict) -> Table:
    """A Rich table: each dataset's baseline, then one row per DFlash variant."""
    rows = []
    for ds in report["datasets"]:
        b = ds["baseline"]
        rows.append([ds["name"], f"{b['engine']} (baseline)", cell(b["tau"]) if b["engine"] == "draft-model" else "",
                     cell(b["decode_tps_median"], "{:.1f}"), cell(b["prompt_tps_median"], "{:.0f}"),
                     cell(b["peak_memory_gb_max"], "{:.3f}"), "1.00x", "1.00x", ""])
        for d in ds["dflash"]:
            differ = "-" if d["outputs_differing"] is None else f"{d['outputs_differing']}/{d['outputs_compared']}"
            rows.append(["", f"dflash {variant_name(d['block_size'])}", cell(d["tau"]),
                         cell(d["decode_tps_median"], "{:.1f}"), cell(d["prompt_tps_median"], "{:.0f}"),
                         cell(d["peak_memory_gb_max"], "{:.3f}"), cell(d["speedup_ratio_of_medians"], "{:.2f}x"),
                         cell(d["speedup_median_of_ratios"], "{:.2f}x"), differ])
    return _table("dflash bench: speed and acceptance", ("dataset", "engine", "tau", "tok/s", "prompt tok/s",
                  "peak GB", "speedup\n(med/med)", "speedup\n(med ratio)", "outputs\ndiffer"), rows, 2)


def cycle_table(report: dict) -> Table:
    """A Rich table of DFlash's time per verify cycle and the ideal against the measured speedup."""
    rows = []
    for ds in report["datasets"]:
        t_ar = ds["baseline"]["s_per_token_median"]
        for d in ds["dflash"]:
            rows.append([ds["name"], str(d["block_size"]), *(cell(d["cycle_ms"][k]) for k in PHASES),
                         cell(None if t_ar is None else 1e3 * t_ar), cell(d["tokens_per_step"]),
                         cell(d["ideal_speedup"], "{:.2f}x"), cell(d["speedup_median_of_ratios"], "{:.2f}x"),
                         cell(d["measured_over_ideal"], "{:.3f}")])
    return _table("time per verify cycle (ms, medians) and loop overhead", ("dataset", "B", *PHASES, "t_AR/token",
                  "tok/step", "ideal", "measured", "measured\n/ideal"), rows, 1)


def histogram_lines(report: dict) -> List[str]:
    """Per dataset and variant, the acceptance-length histogram as shares of steps."""
    lines = []
    for ds in report["datasets"]:
        for d in ds["dflash"]:
            bins = " ".join(f"{k}:{100 * n / (d['steps'] or 1):.0f}%" for k, n in d["acceptance_histogram"].items() if n)
            lines.append(f"{ds['name']} {variant_name(d['block_size'])}: acceptance length {bins or '(no steps)'}")
    return lines


def agent_table(rows: List[dict]) -> Table:
    """The agent-trace summary rows of :func:`dflash_mlx.bench.agent.summarize`, one per trace and mode."""
    out = []
    for r in rows:
        same = "" if r["same_as_cold"] is None else ("yes" if r["same_as_cold"] else "NO")
        taus = " ".join(f"{k}:{v:.2f}" for k, v in r["tau_by_prompt_tokens"].items())
        out.append([r["trace"], r["mode"], str(r["requests"]), str(r["prompt_tokens"]), str(r["reused"]),
                    str(r["prefilled"]), f"{r['ttft_median_ms']:.1f}", f"{r['ttft_total_s']:.3f}",
                    f"{r.get('ttft_vs_cold', 1.0):.3f}", f"{r['total_s']:.2f}", f"{r.get('total_vs_cold', 1.0):.3f}",
                    same, taus])
    return _table("Agent traces: prompt cache (TTFT: time to first token)", (
        "trace", "mode", "req", "prompt tok", "reused", "prefilled", "TTFT median ms", "TTFT sum s", "TTFT vs cold",
        "total s", "total vs cold", "same text", "tau by prompt tokens"), out, 13)
