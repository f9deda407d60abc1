"""``dflash bench``: baseline and DFlash side by side on prompt sets, in one process.

    from dflash_mlx.bench import BenchConfig, bench
    report = bench("models/stories260K", "drafter", ["prompts.jsonl"], num_samples=5,
                   config=BenchConfig(max_tokens=128, block_sizes=[4, 8]), out_dir="out")
"""

from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from ..errors import InputError, MismatchError
from .datasets import load_dataset
from .engines import DFlashEngine, Engine, MlxLmEngine
from .report import build_report, write_report
from .runner import BenchConfig, Runner, parse_baseline

RESULTS_FILE = "results.json"


def make_baseline(spec: str, pair, num_draft_tokens: int = 3) -> Engine:
    """The ``--baseline`` engine (``ar``, ``mlx-lm`` or ``draft-model:PATH``) for a loaded pair.

    Raises:
        InputError, CheckpointError, MismatchError: a bad spec or draft model (vocabulary included).
    """
    kind, path = parse_baseline(spec)
    if kind == "ar":
        return DFlashEngine(pair.target, None)
    if kind == "mlx-lm":
        return MlxLmEngine(pair.model)
    from ..pair.loading import load_model

    draft_model, _, _ = load_model(path, what="baseline draft model")
    vocab = getattr(draft_model.args, "vocab_size", None)
    if vocab != pair.target.vocab_size:
        raise MismatchError(f"--baseline {spec}: the draft model's vocab_size {vocab} differs from the target's "
                            f"{pair.target.vocab_size}; mlx-lm speculative decoding needs the same vocabulary")
    return MlxLmEngine(pair.model, draft_model, num_draft_tokens)


def check_out_dir(out_dir: str | Path, overwrite: bool = False, plots: bool = True) -> Path:
    """Raises InputError for a file, a folder holding files without ``overwrite``, or plots without matplotlib."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; give a folder for results.json and the plots")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"--out {out}: the folder is not empty (an earlier run?); pass --overwrite "
                         "to replace its results, or a new --out")
    if plots:
        from .plots import pyplot

        pyplot()
    return out


def write_outputs(report: dict, out_dir: str | Path, plots: bool) -> Dict[str, str]:
    """Write ``results.json`` and the plots and delete an earlier run's outputs not rewritten; returns
    ``{name: path}``. A failed write (any errno) goes to ``report["not_written"]``, not raised."""
    from .plots import PLOT_FILES

    files: Dict[str, str] = {}
    try:
        files["results"] = str(write_report(report, out_dir))
        if plots:
            from .plots import write_plots

            files.update({k: str(v) for k, v in write_plots(report, out_dir).items()})
        for stale in (Path(out_dir) / name for name in (RESULTS_FILE, *PLOT_FILES)):
            if stale.is_file() and str(stale) not in files.values():
                stale.unlink()
    except OSError as e:
        report["not_written"] = f"{e.filename or out_dir}: {e.strerror or e}"
    return files


def bench(model: str, draft_model: str, datasets: Sequence[str], *, num_samples: Optional[int] = 10,
          baseline: str = "ar", config: Optional[BenchConfig] = None, num_draft_tokens: int = 3,
          out_dir: Optional[str] = None, plots: bool = True, command: Sequence[str] = (),
          progress: Optional[Callable[[str, int, int], None]] = None, pair=None, overwrite: bool = False) -> dict:
    """Load a pair (unless ``pair`` is given), run every dataset, write ``results.json`` and the plots.

    Args:
        datasets: names or files (:func:`load_dataset`); ``num_samples``: the first N of each (None: all).
        baseline: ``ar``, ``mlx-lm`` or ``draft-model:PATH`` (``num_draft_tokens`` drafts per cycle).
        out_dir: the results folder, checked first: new or empty unless ``overwrite``; None: write nothing.
        command: the command line, recorded; ``progress(dataset, done, total)`` after each item.

    Returns:
        The report (``results.json``'s contents) with ``files`` written, and ``not_written`` (path
        and reason) when a write failed.

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
    try:
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out_dir}: cannot create the folder ({e.strerror})") from None
    pair = pair or load(model, draft_model, draft_window=config.draft_window)
    config = replace(config, top_k=effective_top_k(config.top_k, pair.target.vocab_size))
    runner = Runner(pair.target, pair.drafter, make_baseline(baseline, pair, num_draft_tokens), config,
                    tokenizer=pair.tokenizer)
    results = [runner.run_dataset(name, samples, progress) for name, samples in loaded]
    recorded = asdict(config)
    recorded["block_sizes"] = [b if b is not None else pair.drafter.block_size for b in config.block_sizes]
    recorded.update(model=pair.model_path, draft_model=pair.draft_path, baseline=baseline,
                    drafter_format=getattr(pair.drafter, "drafter_format", None), datasets=list(datasets),
                    num_samples=num_samples, num_draft_tokens=num_draft_tokens)
    report = build_report(results, recorded, command)
    report["files"] = write_outputs(report, out_dir, plots) if out_dir is not None else {}
    return report

