"""``dflash bench --agent-trace FILE``: replay agent traces cold, from the prompt cache on
disk (a new process per request), live (one process) and with mlx-lm's prompt cache
(:mod:`dflash_mlx.bench.agent`); a table on stdout, ``results.json`` in ``--out``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional


def run_agent_traces(model: str, draft_model: Optional[str], traces: List[str], max_tokens: int, block_size,
                     prefill_step_size: Optional[int], out: str, overwrite: bool) -> None:
    """Replay each trace in every mode and report (see :mod:`dflash_mlx.bench.agent`).

    Raises:
        InputError: a trace that cannot be read, ``--out`` holding results without ``--overwrite``
            (``--prefill-step-size`` is checked by the command).
    """
    from rich.console import Console
    from rich.table import Table

    from .render import print_table

    from dflash_mlx import InputError, load
    from dflash_mlx.bench.agent import MODES, encode_requests, read_agent_trace, run_trace, summarize, write_results

    requests = {Path(t).stem: read_agent_trace(t) for t in traces}
    results = Path(out) / "results.json"
    if results.exists() and not overwrite:
        raise InputError(f"--out {out} already holds results.json; pass --overwrite to replace it")
    console = Console(stderr=True)
    pair = load(model, draft_model)
    kwargs = {"block_size": block_size}
    if prefill_step_size:
        kwargs["prefill_step_size"] = prefill_step_size
    records = []
    warm = encode_requests(pair.tokenizer, ["Once upon a time"])
    run_trace(pair, "warm-up", warm, MODES, 8, **kwargs)  # first calls compile and allocate: untimed
    for name, reqs in requests.items():
        records += run_trace(pair, name, encode_requests(pair.tokenizer, reqs), MODES, max_tokens,
                             progress=lambda s: console.print(s), **kwargs)
    rows = summarize(records)
    table = Table(title="Agent traces: prompt cache (TTFT: time to first token)")
    for col in ("trace", "mode", "req", "prompt tok", "reused", "prefilled", "TTFT median ms", "TTFT sum s",
                "TTFT vs cold", "total s", "total vs cold", "same text", "tau by prompt tokens"):
        table.add_column(col)
    for r in rows:
        same = "" if r["same_as_cold"] is None else ("yes" if r["same_as_cold"] else "NO")
        taus = " ".join(f"{k}:{v:.2f}" for k, v in r["tau_by_prompt_tokens"].items())
        table.add_row(r["trace"], r["mode"], str(r["requests"]), str(r["prompt_tokens"]), str(r["reused"]),
                      str(r["prefilled"]), f"{r['ttft_median_ms']:.1f}", f"{r['ttft_total_s']:.3f}",
                      f"{r.get('ttft_vs_cold', 1.0):.3f}", f"{r['total_s']:.2f}", f"{r.get('total_vs_cold', 1.0):.3f}",
                      same, taus)
    print_table(table)
    path = write_results(results, records, rows, ["dflash", *sys.argv[1:]])
    console.print(f"wrote {path}")
