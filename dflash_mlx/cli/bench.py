"""``dflash bench``: baseline and DFlash side by side on prompt sets; table, JSON, plots."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from dflash_mlx.ranges import check_number

from .common import (MODEL_HELP, check_sampling, guard, parse_draft_window, resolve_models, top_k_option, verify_option,
                     warn)


# Over 60 lines: a typer command: its length is its option list
def bench(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="DFlash drafter: a local folder or repo id."),
    verify: bool = verify_option(),
    dataset: List[str] = typer.Option(
        ["gsm8k"], "--dataset", "-d",
        help="gsm8k, math500, humaneval, mbpp, mt-bench, alpaca (Hugging Face, online) or a local "
        "file: a .jsonl/.jsonl.gz in those formats or of 'prompt' or 'messages' rows. Repeat or "
        "separate with commas for several.",
    ),
    num_samples: int = typer.Option(
        10, "--num-samples", "-n", help="First N samples of each dataset; 0 for all of them."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens per generation."),
    block_size: Optional[List[str]] = typer.Option(
        None, "--block-size",
        help="Block sizes to sweep: '--block-size 4 8 16 auto' (or 4,8,16,auto); auto chooses the verify "
        "width per step by measured cost, plain decoding included. Default: the drafter's trained size.",
    ),
    tree_budget: Optional[List[str]] = typer.Option(
        None, "--tree-budget",
        help="DDTree budgets to run too, one row each: '--tree-budget 16 32 64 auto' (nodes per tree; "
        "auto: budgets and chain widths by measured cost). Attention-only targets; hybrids keep chains.",
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = top_k_option(),
    min_p: float = typer.Option(0.0, "--min-p", help="Min-p threshold, in [0, 1]; 0 is off."),
    seed: int = typer.Option(0, "--seed", help="PRNG seed; every run starts from it."),
    baseline: str = typer.Option(
        "ar", "--baseline",
        help="ar (this engine, no drafter), mlx-lm (plain mlx-lm decoding) or draft-model:PATH "
        "(mlx-lm speculative decoding with an autoregressive draft model).",
    ),
    num_draft_tokens: int = typer.Option(
        3, "--num-draft-tokens", help="Drafts per cycle for --baseline draft-model:PATH."
    ),
    enable_thinking: bool = typer.Option(
        False, "--enable-thinking", help="Turn thinking on in the chat template (off by default)."
    ),
    simulate_acceptance: Optional[str] = typer.Option(
        None, "--simulate-acceptance",
        help="A: replace the drafter's proposals by the target's greedy continuation for the first A "
        "slots of each block and wrong tokens after (the drafter still runs, for its cost). Or FILE: replay "
        "the accepted lengths a real run recorded (`dflash generate --json` output, its acceptance_trace; "
        "record at the trained block size), one per block drafted. Needs --temp 0.",
    ),
    draft_window: Optional[str] = typer.Option(
        None, "--draft-window", help="SINK,WINDOW: the drafter keeps its first SINK and last WINDOW context rows."
    ),
    repeats: int = typer.Option(1, "--repeats", help="Runs of each engine per prompt."),
    warmup_tokens: int = typer.Option(
        32, "--warmup-tokens", help="Tokens of each engine's untimed warm-up run; 0: none."
    ),
    out: str = typer.Option(
        "dflash-bench", "--out", "-o",
        help="Folder for results.json and the PNG plots; checked before the run: new or empty, or --overwrite.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the results of an earlier run in --out (its other files stay)."
    ),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots (needs the 'plot' extra)."),
    agent_trace: Optional[List[str]] = typer.Option(
        None, "--agent-trace",
        help="Replay this agent trace instead (JSONL of 'prompt' or 'messages' rows whose prompts share growing "
        "prefixes; repeat for several): cold, from the prompt cache on disk with a new cache per request, live, "
        "and mlx-lm with its prompt cache. Reports tokens reused and prefilled, time to first token, tau.",
    ),
    prefill_step_size: Optional[int] = typer.Option(
        None, "--prefill-step-size", help="Prompt tokens per prefill chunk for --agent-trace (default: generate's)."),
) -> None:
    """Benchmark DFlash against a baseline: tau, tokens/s, speedup and loop overhead.

    \b
    Examples:
      dflash bench --model M --draft-model D --dataset ../shared/datasets/gsm8k_test.jsonl -n 20
      dflash bench --model M --draft-model D --dataset prompts.jsonl --block-size 4 8 16 auto --baseline mlx-lm
      dflash bench --model M --draft-model D --dataset prompts.jsonl --tree-budget 16 32 64 auto
      dflash bench --model M --draft-model D --dataset gsm8k --simulate-acceptance 5
      dflash bench --model M --draft-model D --agent-trace benchmarks/traces/agent_mbpp.jsonl
    """
    guard(lambda: check_number("--prefill-step-size", prefill_step_size, at_least=1))
    if agent_trace:
        return guard(lambda: _agent(model, draft_model, verify, agent_trace, max_tokens, block_size, list(ctx.args),
                                    prefill_step_size, out, overwrite))
    args = dict(locals())
    for name in ("ctx", "agent_trace", "prefill_step_size"):
        args.pop(name)
    guard(lambda: _run(extra=list(ctx.args), **args))


def split_extra(block_size, tree_budget, extra: List[str], argv: Optional[List[str]] = None):
    """Which list option each value click left over belongs to (``--block-size 4 8
    --tree-budget 16 32``): the flag it follows on the command line; when the command
    line is not at hand, the flag given last.

    Returns:
        ``(extra block sizes, extra tree budgets)``.
    """
    if not extra or not (block_size and tree_budget):
        return (extra, []) if not tree_budget or block_size else ([], extra)
    argv = sys.argv if argv is None else argv
    owned = {"--block-size": [], "--tree-budget": []}
    owner, first = None, False
    for a in argv:
        if a.startswith("-"):
            owner, first = (a if a in owned else None), True
        elif owner is not None and first:
            first = False  # the value click parsed as the option's own
        elif owner is not None:
            owned[owner].append(a)
    if sorted(owned["--block-size"] + owned["--tree-budget"]) == sorted(extra):
        return owned["--block-size"], owned["--tree-budget"]
    last = {f: max((i for i, a in enumerate(argv) if a == f), default=-1) for f in owned}
    return (extra, []) if last["--block-size"] > last["--tree-budget"] else ([], extra)


def parse_block_sizes(values: Optional[List[str]], extra: List[str], flag: str = "--block-size",
                      default=(None,)) -> list:
    """``--block-size 4 8 16 auto``: click hands the values after the first one over as
    extra arguments; commas work too.

    Raises:
        InputError: a value that is neither an integer nor ``auto``, or stray arguments.
    """
    from dflash_mlx.errors import InputError

    if extra and not values:
        raise InputError(f"unexpected argument(s): {' '.join(extra)}")
    sizes = []
    for v in list(values or []) + extra:
        for part in str(v).split(","):
            part = part.strip()
            if part == "auto":
                sizes.append(part)
            elif part:
                try:
                    sizes.append(int(part))
                except ValueError:
                    raise InputError(f"{flag} expects integers or 'auto', got '{part}'") from None
    return sizes or list(default)


def parse_simulate_acceptance(value: Optional[str]):
    """``--simulate-acceptance``: an int A, or a trace file's accepted lengths (a list).

    Raises:
        InputError: naming the flag, when it is neither an int nor a readable trace.
    """
    from dflash_mlx.errors import InputError

    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        pass
    from dflash_mlx.bench.simulate import read_trace

    try:
        return read_trace(value)
    except ValueError as e:
        raise InputError(f"--simulate-acceptance: {e}") from None


def _agent(model, draft_model, verify, traces, max_tokens, block_size, extra, prefill_step_size, out,
           overwrite) -> None:
    """``--agent-trace``: the prompt-cache benchmark (dflash_mlx/cli/bench_agent.py) instead of the prompt sets."""
    from dflash_mlx import InputError

    from .bench_agent import run_agent_traces

    sizes = parse_block_sizes(block_size, extra)
    model, draft_model = resolve_models(model, draft_model, verify)
    if draft_model is None:
        raise InputError("dflash bench needs --draft-model (the DFlash drafter to measure)")
    run_agent_traces(model, draft_model, traces, max_tokens, sizes[0], prefill_step_size, out, overwrite)


def files_lines(report: dict) -> List[str]:
    """``wrote PATH`` per file written, and one warning when a write failed."""
    lines = [f"wrote {path}" for path in report["files"].values()]
    if report.get("not_written"):
        lines.append(f"warning: cannot write {report['not_written']}; the results are in the table above only")
    return lines


def checked_config(max_tokens, block_size, tree_budget, temp, top_p, top_k, min_p, seed, enable_thinking,
                   simulate_acceptance, draft_window, repeats, warmup_tokens, extra):
    """The run's flags as a :class:`dflash_mlx.bench.runner.BenchConfig`, checked before
    anything loads (mlx-lm takes 2-3 s to import).

    Raises:
        InputError: naming the flag out of range.
    """
    check_sampling(temp, top_p, top_k, min_p, max_tokens)
    extra_sizes, extra_budgets = split_extra(block_size, tree_budget, extra)
    budgets = parse_block_sizes(tree_budget, extra_budgets, "--tree-budget", default=())
    sizes = parse_block_sizes(block_size, extra_sizes) if block_size or extra_sizes or not budgets else []
    from dflash_mlx.bench.runner import BenchConfig

    config = BenchConfig(max_tokens=max_tokens, block_sizes=sizes, tree_budgets=budgets, temp=temp, top_p=top_p,
                         top_k=top_k, min_p=min_p, seed=seed, repeats=repeats,
                         simulate_acceptance=parse_simulate_acceptance(simulate_acceptance),
                         enable_thinking=enable_thinking, warmup_tokens=warmup_tokens,
                         draft_window=parse_draft_window(draft_window))
    config.check()
    return config


def _run(model, draft_model, verify, dataset, num_samples, max_tokens, block_size, tree_budget, temp, top_p, top_k, min_p,
         seed, baseline, num_draft_tokens, enable_thinking, simulate_acceptance, draft_window, repeats, warmup_tokens,
         out, overwrite, plots, extra) -> None:
    from rich.console import Console
    from rich.progress import (
        BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    )

    from dflash_mlx.errors import InputError

    check_number("--num-samples", num_samples, at_least=0, rule="0 (all samples) or more")
    check_number("--num-draft-tokens", num_draft_tokens, at_least=1)
    config = checked_config(max_tokens, block_size, tree_budget, temp, top_p, top_k, min_p, seed, enable_thinking,
                            simulate_acceptance, draft_window, repeats, warmup_tokens, extra)
    datasets = [d for spec in dataset for d in spec.split(",") if d]
    from dflash_mlx.bench.plots import plots_available

    model, draft_model = resolve_models(model, draft_model, verify)
    if draft_model is None:
        raise InputError("dflash bench needs --draft-model (the DFlash drafter to measure)")
    if plots and not plots_available():
        warn("matplotlib is not installed: no plots are drawn (pip install 'dflash-mlx[plot]', or pass --no-plots)")
        plots = False
    from dflash_mlx.bench import bench
    from .bench_tables import cycle_table, histogram_lines, results_table

    console = Console(stderr=True)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    bar, tasks = Progress(*columns, console=console, transient=False), {}

    def progress(name: str, done: int, total: int) -> None:
        if not tasks:  # shown from the first result on: errors found up front stay one line
            bar.start()
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        bar.update(tasks[name], completed=done)

    try:
        report = bench(model, draft_model, datasets, num_samples=num_samples or None, baseline=baseline,
                       config=config, num_draft_tokens=num_draft_tokens, out_dir=out, plots=plots,
                       command=["dflash", *sys.argv[1:]], progress=progress, overwrite=overwrite)
    finally:
        if tasks:
            bar.stop()
    from .render import print_table

    print_table(results_table(report))
    print_table(cycle_table(report))
    for line in histogram_lines(report):
        console.print(line)
    for line in files_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
