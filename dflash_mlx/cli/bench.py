"""``dflash bench``: baseline and DFlash side by side on prompt sets; table, JSON, plots."""

import sys
from types import SimpleNamespace
from typing import Annotated, List, Optional

import typer
from typer import Option

from dflash_mlx.errors import InputError
from dflash_mlx.ranges import check_number

from .common import (DraftModel, DraftWindow, MaxTokens, MinP, Model, PrefillStep, PromptLookup, Temp, TopK, TopP,
                     Verify, check_sampling, guard, parse_draft_window, print_table, progress_bars, resolve_models, warn)


def bench(
    ctx: typer.Context,
    model: Model = None, draft_model: DraftModel = None, verify: Verify = False,
    dataset: Annotated[List[str], Option("--dataset", "-d", help=(
        "gsm8k, math500, humaneval, mbpp, mt-bench, alpaca (online) or a .jsonl[.gz] of those or of 'prompt' "
        "or 'messages' rows; repeatable."))] = ["gsm8k"],
    num_samples: Annotated[int, Option("--num-samples", "-n", help="First N samples per dataset; 0 for all.")] = 10,
    max_tokens: MaxTokens = 256,
    block_size: Annotated[Optional[List[str]], Option("--block-size", help=(
        "Block sizes to sweep: '--block-size 4 8 16 auto' (default: the trained size)."))] = None,
    tree_budget: Annotated[Optional[List[str]], Option("--tree-budget", help=(
        "DDTree budgets to run too, one row each: '--tree-budget 16 32 64 auto'."))] = None,
    prompt_lookup: PromptLookup = "auto", temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0,
    seed: Annotated[int, Option("--seed", help="PRNG seed; every run starts from it.")] = 0,
    baseline: Annotated[str, Option("--baseline", help=(
        "ar (this engine, no drafter), mlx-lm, or draft-model:PATH (mlx-lm speculative decoding)."))] = "ar",
    num_draft_tokens: Annotated[int, Option("--num-draft-tokens", help="Drafts per cycle of draft-model:PATH.")] = 3,
    enable_thinking: Annotated[bool, Option("--enable-thinking", help="Thinking on in the chat template.")] = False,
    simulate_acceptance: Annotated[Optional[str], Option("--simulate-acceptance", help=(
        "A: accept exactly A drafted tokens per block; or FILE: replay the acceptance_trace of `dflash generate "
        "--json` output. Needs --temp 0."))] = None,
    draft_window: DraftWindow = None,
    repeats: Annotated[int, Option("--repeats", help="Runs of each engine per prompt.")] = 1,
    warmup_tokens: Annotated[int, Option("--warmup-tokens", help="Tokens of each untimed warm-up; 0: none.")] = 32,
    out: Annotated[str, Option("--out", "-o", help=(
        "Folder for results.json and the PNG plots: new or empty, or --overwrite."))] = "dflash-bench",
    overwrite: Annotated[bool, Option("--overwrite", help="Replace the results of an earlier run in --out.")] = False,
    plots: Annotated[Optional[bool], Option("--plots/--no-plots", help=(
        "Write the PNG plots (needs matplotlib); default: where matplotlib is installed."))] = None,
    agent_trace: Annotated[Optional[List[str]], Option("--agent-trace", help=(
        "Replay this agent trace instead (JSONL of prompts with growing shared prefixes): cold, from the prompt "
        "cache on disk, live, and mlx-lm; repeatable."))] = None,
    prefill_step_size: PrefillStep = None,
) -> None:
    """Benchmark DFlash against a baseline: tau, tokens/s, speedup and loop overhead.

    \b
    Examples:
      dflash bench --model M --draft-model D --dataset prompts.jsonl --block-size 4 8 16 auto --baseline mlx-lm
      dflash bench --model M --draft-model D --dataset gsm8k --tree-budget 16 32 64 auto
      dflash bench --model M --draft-model D --agent-trace benchmarks/traces/agent_mbpp.jsonl
    """
    o = SimpleNamespace(**locals(), extra=list(ctx.args))
    guard(lambda: _agent(o) if o.agent_trace else _run(o))


def split_extra(block_size, tree_budget, extra: List[str], argv: Optional[List[str]] = None):
    """``(extra block sizes, extra tree budgets)``: click's leftover values, each owned by the flag it follows in
    ``argv`` (default ``sys.argv``); when that does not tell, by the flag given last."""
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
    """``--block-size 4 8 16 auto`` or ``--tree-budget``: the flag's values, then ``extra`` (commas work too),
    parsed by :mod:`dflash_mlx.decode.width`; InputError for a bad one."""
    from dflash_mlx.decode.width import parse_block_size, parse_tree_budget

    if extra and not values:
        raise InputError(f"unexpected argument(s): {' '.join(extra)}")
    parse = parse_tree_budget if flag == "--tree-budget" else parse_block_size
    sizes = [parse(part.strip()) for v in list(values or []) + extra for part in str(v).split(",") if part.strip()]
    return sizes or list(default)


def parse_simulate_acceptance(value: Optional[str]):
    """``--simulate-acceptance``: an int A, or the accepted lengths of a trace file (else InputError)."""
    from dflash_mlx.bench.simulate import read_trace

    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return read_trace(value)


def checked_config(o):
    """The flags as a checked BenchConfig (InputError naming the flag)."""
    check_sampling(o.temp, o.top_p, o.top_k, o.min_p, o.max_tokens)
    check_number("--num-samples", o.num_samples, at_least=0, rule="0 (all samples) or more")
    check_number("--num-draft-tokens", o.num_draft_tokens, at_least=1)
    extra_sizes, extra_budgets = split_extra(o.block_size, o.tree_budget, o.extra)
    budgets = parse_block_sizes(o.tree_budget, extra_budgets, "--tree-budget", default=())
    sizes = parse_block_sizes(o.block_size, extra_sizes) if o.block_size or extra_sizes or not budgets else []
    from dflash_mlx.bench.runner import BenchConfig

    config = BenchConfig(max_tokens=o.max_tokens, block_sizes=sizes, tree_budgets=budgets, temp=o.temp,
                         top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, seed=o.seed, repeats=o.repeats,
                         simulate_acceptance=parse_simulate_acceptance(o.simulate_acceptance),
                         enable_thinking=o.enable_thinking, warmup_tokens=o.warmup_tokens,
                         draft_window=parse_draft_window(o.draft_window), prompt_lookup=o.prompt_lookup == "auto")
    config.check()
    return config


def _pair(o) -> None:
    """Check --prefill-step-size; resolve --model/--draft-model in place (bench measures a drafter)."""
    check_number("--prefill-step-size", o.prefill_step_size, at_least=1)
    from dflash_mlx.pair.sharded import refuse_ranks

    refuse_ranks("dflash bench")
    o.model, o.draft_model = resolve_models(o.model, o.draft_model, o.verify)
    if o.draft_model is None:
        raise InputError("dflash bench needs --draft-model (the DFlash drafter to measure)")


def _agent(o) -> None:
    """``--agent-trace``: replay each trace in every mode of :mod:`dflash_mlx.bench.agent`; a table, results.json."""
    from pathlib import Path

    from rich.console import Console

    from dflash_mlx.bench.agent import MODES, encode_requests, read_agent_trace, run_trace, summarize, write_results
    from dflash_mlx.pair.loading import load

    from .bench_tables import AGENT_DROP, agent_table
    kwargs = {"block_size": parse_block_sizes(o.block_size, o.extra)[0]}
    _pair(o)
    requests = {Path(t).stem: read_agent_trace(t) for t in o.agent_trace}
    results = Path(o.out) / "results.json"
    if results.exists() and not o.overwrite:
        raise InputError(f"--out {o.out} already holds results.json; pass --overwrite to replace it")
    if o.prefill_step_size:
        kwargs["prefill_step_size"] = o.prefill_step_size
    console, pair, records = Console(stderr=True), load(o.model, o.draft_model), []
    warm = encode_requests(pair.tokenizer, ["Once upon a time"])
    run_trace(pair, "warm-up", warm, MODES, 8, **kwargs)  # first calls compile and allocate: untimed
    for name, reqs in requests.items():
        records += run_trace(pair, name, encode_requests(pair.tokenizer, reqs), MODES, o.max_tokens,
                             progress=lambda s: console.print(s), **kwargs)
    rows = summarize(records)
    print_table(agent_table(rows), drop=AGENT_DROP)
    console.print(f"wrote {write_results(results, records, rows, ['dflash', *sys.argv[1:]])}")


def _run(o) -> None:
    from rich.console import Console

    config = checked_config(o)
    datasets = [d for spec in o.dataset for d in spec.split(",") if d]
    _pair(o)
    from dflash_mlx.bench import bench
    from dflash_mlx.bench.plots import plots_available
    from .bench_tables import CYCLE_DROP, RESULTS_DROP, cycle_table, histogram_lines, results_table

    if o.plots and not plots_available():  # asked for: said once; by default quietly none
        warn("matplotlib is not installed: no plots are drawn (pip install matplotlib, or pass --no-plots)")
    o.plots = bool(o.plots is not False and plots_available())
    console = Console(stderr=True)
    with progress_bars(console) as progress:
        report = bench(o.model, o.draft_model, datasets, num_samples=o.num_samples or None, baseline=o.baseline,
                       config=config, num_draft_tokens=o.num_draft_tokens, out_dir=o.out, plots=o.plots,
                       command=["dflash", *sys.argv[1:]], progress=progress, overwrite=o.overwrite)
    print_table(results_table(report), drop=RESULTS_DROP)
    print_table(cycle_table(report), drop=CYCLE_DROP)
    for line in histogram_lines(report):
        console.print(line)
    for path in report["files"].values():
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
    if report.get("not_written"):
        console.print(f"warning: cannot write {report['not_written']}; the results are in the table above only",
                      markup=False, highlight=False, soft_wrap=True)
