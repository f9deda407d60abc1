"""``dflash bench``: speed and acceptance on real prompt sets, baseline and DFlash
side by side (``datasets`` loads prompts, ``engines`` decode, ``runner`` times, ``report``
digests, ``plots`` draws, ``simulate`` replays an acceptance trace).

From Python::

    from dflash_mlx.bench import BenchConfig, bench
    report = bench("models/stories260K", "drafter", ["prompts.jsonl"], num_samples=5,
                   config=BenchConfig(max_tokens=128, block_sizes=[4, 8]), out_dir="out")
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .datasets import Sample, load_dataset
from .report import build_report, results_table, summarize, write_report
from .engines import DFlashEngine, Engine, MlxLmEngine, MlxLmSpeculativeEngine
from .runner import BenchConfig, DatasetResult, Runner, RunRecord, parse_baseline, timed_run


def make_baseline(spec: str, pair, num_draft_tokens: int = 3) -> Engine:
    """Build the ``--baseline`` engine for a loaded pair.

    Args:
        spec: ``ar`` (this engine, no drafter), ``mlx-lm`` (plain mlx-lm decoding)
            or ``draft-model:PATH`` (mlx-lm speculative decoding with an
            autoregressive draft model from PATH or a repo id).
        pair: a :class:`dflash_mlx.Pair`.
        num_draft_tokens: drafts per cycle for ``draft-model``.

    Raises:
        InputError: unknown spec. CheckpointError, MismatchError: the draft model
            cannot be loaded or its vocabulary differs from the target's.
    """
    kind, path = parse_baseline(spec)
    if kind == "ar":
        return DFlashEngine(pair.target, None)
    if kind == "mlx-lm":
        return MlxLmEngine(pair.model)
    from ..errors import MismatchError
    from ..pair.loading import load_model

    draft_model, _, _ = load_model(path, what="baseline draft model")
    vocab = getattr(draft_model.args, "vocab_size", None)
    if vocab != pair.target.vocab_size:
        raise MismatchError(
            f"--baseline {spec}: the draft model's vocab_size {vocab} differs from the target's "
            f"{pair.target.vocab_size}; mlx-lm speculative decoding needs the same vocabulary"
        )
    return MlxLmSpeculativeEngine(pair.model, draft_model, num_draft_tokens)


RESULTS_FILE = "results.json"


def check_out_dir(out_dir: str | Path, overwrite: bool = False, plots: bool = True) -> Path:
    """Check the output folder before any work (it is made by :func:`make_out_dir`).

    Raises:
        InputError: ``out_dir`` is a file, or already holds files and ``overwrite`` is
            False; plots asked for without matplotlib.
    """
    from ..errors import InputError

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; give a folder for results.json and the plots")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"--out {out}: the folder is not empty (an earlier run?); pass --overwrite "
                         "to replace its results, or a new --out")
    if plots:
        from .plots import require_matplotlib

        require_matplotlib()
    return out


def make_out_dir(out_dir: str | Path) -> Path:
    """Create the output folder, once the datasets are in (a dataset that cannot be had
    leaves no empty folder behind).

    Raises:
        InputError: the folder cannot be created (any errno).
    """
    from ..errors import InputError

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    return out


def remove_stale(out_dir: str | Path, written: Sequence[str]) -> List[Path]:
    """Delete the bench outputs of an earlier run that this run did not rewrite
    (e.g. plots after ``--no-plots``), so a folder never mixes two runs."""
    from .plots import PLOT_FILES

    stale = [Path(out_dir) / name for name in (RESULTS_FILE, *PLOT_FILES)]
    stale = [p for p in stale if p.is_file() and str(p) not in set(written)]
    for p in stale:
        p.unlink()
    return stale


# Over 60 lines: the library entry point: its docstring lists every argument
def bench(
    model: str,
    draft_model: str,
    datasets: Sequence[str],
    *,
    num_samples: Optional[int] = 10,
    baseline: str = "ar",
    config: Optional[BenchConfig] = None,
    num_draft_tokens: int = 3,
    out_dir: Optional[str] = None,
    plots: bool = True,
    command: Sequence[str] = (),
    progress: Optional[Callable[[str, int, int], None]] = None,
    pair=None,
    overwrite: bool = False,
) -> dict:
    """Load a pair, run every dataset, write ``results.json`` and the plots.

    Args:
        model, draft_model: target and DFlash drafter (folders or repo ids); ignored
            when ``pair`` is given.
        datasets: names (``gsm8k``, ...) or files, see :func:`load_dataset`.
        num_samples: first N samples of each dataset (None: all).
        baseline: ``ar``, ``mlx-lm`` or ``draft-model:PATH``.
        config: :class:`BenchConfig` (max tokens, block sizes, sampling, repeats,
            simulated acceptance).
        num_draft_tokens: drafts per cycle of the ``draft-model`` baseline.
        out_dir: where ``results.json`` and the PNGs go (nothing is written if None).
            It is checked before any work: it must be empty (or new) unless
            ``overwrite``, in which case the earlier run's outputs are replaced.
        plots: draw the PNGs (needs matplotlib).
        command: the command line, recorded in the report.
        progress: ``progress(dataset, done, total)`` after each item.
        pair: an already loaded :class:`dflash_mlx.Pair`.
        overwrite: write into a folder that already holds files.

    Returns:
        The report dict (the contents of ``results.json``), with ``files`` listing
        what was written, and ``not_written`` (the path and the reason) when a write
        into ``out_dir`` failed (any errno): the results are then in the dict only.

    Raises:
        DFlashError subclasses for bad input (datasets, flags, checkpoints).
    """
    from ..pair.loading import load
    from ..sampling import effective_top_k

    config = config or BenchConfig()
    config.check()
    if out_dir is not None:
        check_out_dir(out_dir, overwrite, plots)
    loaded = [load_dataset(d, num_samples) for d in datasets]  # fail before loading models
    if out_dir is not None:
        make_out_dir(out_dir)
    pair = pair or load(model, draft_model, draft_window=config.draft_window)
    config = replace(config, top_k=effective_top_k(config.top_k, pair.target.vocab_size))
    engine = make_baseline(baseline, pair, num_draft_tokens)
    runner = Runner(pair.target, pair.drafter, engine, config, tokenizer=pair.tokenizer)
    results = [runner.run_dataset(name, samples, progress) for name, samples in loaded]
    report = build_report(results, _config_dict(config, pair, baseline, datasets, num_samples, num_draft_tokens),
                          command)
    files: Dict[str, str] = {}
    if out_dir is not None:
        try:
            files["results"] = str(write_report(report, out_dir))
            if plots:
                from .plots import write_plots

                files.update({k: str(v) for k, v in write_plots(report, out_dir).items()})
            remove_stale(out_dir, list(files.values()))
        except OSError as e:  # WriteError: any errno; the report is still returned (and printed)
            report["not_written"] = f"{e.filename or out_dir}: {e.strerror or e}"
    report["files"] = files
    return report


def _config_dict(config: BenchConfig, pair, baseline, datasets, num_samples, num_draft_tokens) -> dict:
    from dataclasses import asdict

    out = asdict(config)
    out["block_sizes"] = [b if b is not None else pair.drafter.block_size for b in config.block_sizes]
    out.update(model=pair.model_path, draft_model=pair.draft_path, baseline=baseline,
               drafter_format=getattr(pair.drafter, "drafter_format", None),
               datasets=list(datasets), num_samples=num_samples, num_draft_tokens=num_draft_tokens)
    return out


__all__: List[str] = [
    "BenchConfig", "DFlashEngine", "DatasetResult", "Engine", "MlxLmEngine", "MlxLmSpeculativeEngine",
    "RunRecord", "Runner", "Sample", "bench", "check_out_dir", "make_out_dir", "remove_stale", "build_report", "load_dataset", "make_baseline",
    "results_table", "summarize", "timed_run", "write_report",
]
