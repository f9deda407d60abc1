"""``dflash data`` (regenerate responses with the target) and ``dflash train``."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dflash_mlx.ranges import check_number

from .common import guard, parse_template_config, quiet_transformers
from .render import fitted, print_table

console = Console(stderr=True)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console)


def data(
    model: str = typer.Option(..., "--model", help="Target: local mlx-lm folder or HF repo id."),
    out: Path = typer.Option(..., "--out", help="Data folder (shards + manifest). Re-running resumes."),
    prompts: List[Path] = typer.Option([], "--prompts", help="JSONL of {'prompt': ...} or {'messages': [...]} rows; repeatable."),
    text: List[Path] = typer.Option([], "--text", help="Plain text cut into prompts (documents split by blank lines); repeatable."),
    self_prompts: int = typer.Option(0, "--self-prompts", help="Also sample N openings from the target itself (base models)."),
    self_prompt_tokens: int = typer.Option(32, "--self-prompt-tokens", help="Tokens sampled per opening."),
    self_prompt_style: str = typer.Option(
        "prefix", "--self-prompt-style",
        help="prefix: BOS + the sampled tokens; sentence: a few words from a sentence inside the sampled text.",
    ),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config", help="JSON for the chat template, e.g. '{\"enable_thinking\": false}': match later use."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Response tokens per prompt; less than the target's context."),
    max_length: Optional[int] = typer.Option(
        None, "--max-length",
        help="Most tokens per sequence, at most the target's context; longer prompts are an error. "
        "Default: 3072 or the context, whichever is smaller.",
    ),
    temp: float = typer.Option(0.0, "--temp", help="Regeneration temperature (0 = greedy)."),
    batch_size: int = typer.Option(32, "--batch-size", help="Sequences generated together."),
    shard_size: int = typer.Option(256, "--shard-size", help="Prompts per shard."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Regenerate responses with the target itself, into resumable shards.

    \b
    Example:
      dflash data --model Qwen/Qwen3-4B --prompts prompts.jsonl --chat-template-config '{"enable_thinking": false}' --out data/
    """
    args = dict(locals())
    guard(lambda: _data(**args))


def _data(model, out, prompts, text, self_prompts, self_prompt_tokens, self_prompt_style, chat_template_config, max_tokens,
          max_length, temp, batch_size, shard_size, seed) -> None:
    import numpy as np

    from dflash_mlx.errors import InputError

    from .common import check_out_folder

    # Flags first, then the imports of mlx-lm and transformers (2-3 s): a bad flag is
    # reported at once.
    check_lengths(max_tokens, max_length, None)
    for flag, value, least in (("--self-prompts", self_prompts, 0), ("--self-prompt-tokens", self_prompt_tokens, 1),
                               ("--temp", temp, 0), ("--batch-size", batch_size, 1), ("--shard-size", shard_size, 1)):
        check_number(flag, value, at_least=least)
    check_number("--seed", seed, at_least=0, at_most=2**63 - 1)  # seed + i seeds the i-th batch
    check_out_folder(out)

    if not (prompts or text or self_prompts):
        raise InputError("no prompt source: give --prompts FILE, --text FILE or --self-prompts N")
    template = parse_template_config(chat_template_config)

    from dflash_mlx import load
    from dflash_mlx.prompt import context_length
    from dflash_mlx.train.data import (
        encode_prompts, prompts_from_text, read_prompt_file, regenerate, response_end_token,
    )
    from dflash_mlx.train.data import self_prompts as sample_openings

    quiet_transformers()
    pair = load(model)
    max_length = check_lengths(max_tokens, max_length, context_length(pair.target))
    rows = [row for path in prompts for row in read_prompt_file(path)]
    rng = np.random.default_rng(seed)
    rows += [row for path in text for row in prompts_from_text(path, rng)]
    ids = encode_prompts(pair.tokenizer, rows, template)
    # Rows are rendered with the chat template when there is one; openings never are.
    ends = [response_end_token(pair.tokenizer, templated=True)] * len(ids)
    if self_prompts:
        with console.status(f"sampling {self_prompts} openings from the target"):
            openings = sample_openings(pair.model, pair.tokenizer, self_prompts, self_prompt_tokens, seed,
                                       style=self_prompt_style)
        ids += openings
        ends += [response_end_token(pair.tokenizer, templated=False)] * len(openings)
    with _progress() as progress:
        task = progress.add_task("regenerating", total=len(ids), status="")
        regenerate(pair.model, pair.tokenizer, ids, out, max_tokens=max_tokens, max_length=max_length, temp=temp,
                   shard_size=shard_size, batch_size=batch_size, seed=seed, target_id=str(model), end_tokens=ends,
                   progress=lambda done, total: progress.update(task, completed=done))
    console.print(f"wrote {len(ids)} sequences to {out}")


def check_lengths(max_tokens: int, max_length: Optional[int], context: Optional[int]) -> int:
    """``--max-length`` (default 3072, capped at the target's context) after range checks.

    Raises:
        InputError: ``--max-tokens`` or ``--max-length`` below 1 or past the context.
    """
    from dflash_mlx import InputError

    check_number("--max-tokens", max_tokens, at_least=1)
    check_number("--max-length", max_length, at_least=2)
    if context is not None:
        if max_tokens >= context:
            raise InputError(f"--max-tokens {max_tokens} does not fit the target's context of {context} tokens "
                             "(max_position_embeddings) with a prompt")
        if max_length is not None and max_length > context:
            raise InputError(f"--max-length {max_length} is past the target's context of {context} tokens "
                             "(max_position_embeddings)")
    return max_length if max_length is not None else min(3072, context or 3072)


# Over 60 lines: a typer command: its length is its option list
def train(
    model: str = typer.Option(..., "--model", help="Target: local mlx-lm folder or HF repo id (frozen)."),
    data_dirs: List[Path] = typer.Option(..., "--data", help="Folder made by `dflash data`; repeat to mix several."),
    out: Path = typer.Option(..., "--out", help="Drafter folder (released format); checkpoints go in OUT/checkpoints."),
    layers: int = typer.Option(1, "--layers", help="Drafter layers."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="The drafter's block size B (the largest it drafts); default 16, or the largest of --block-sizes."
    ),
    block_sizes: Optional[str] = typer.Option(
        None, "--block-sizes",
        help="Train at several block sizes, one drawn per sequence, e.g. 4,8,16: the drafter then drafts well at each. "
        "Default: --block-size only.",
    ),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma list, e.g. 1,9,17; default: spread evenly."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="MASK id; default: an unused vocabulary id."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="Drafter MLP width; default: the target's."),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak AdamW learning rate."),
    warmup: float = typer.Option(0.04, "--warmup", help="Warm-up fraction of the steps, then cosine decay."),
    grad_accum: int = typer.Option(4, "--grad-accum", help="Sequences per optimizer step."),
    anchors: int = typer.Option(512, "--anchors", help="Blocks sampled per sequence."),
    anchor_chunk: int = typer.Option(
        64, "--anchor-chunk",
        help="Blocks per forward/backward pass (0: all at once); bounds memory, same result up to rounding.",
    ),
    gamma: Optional[str] = typer.Option(
        None, "--gamma", help="Loss decay over block rows: one value, or one per --block-sizes entry; default 7 (B=16), 4 (B<=8)."
    ),
    kl_weight: float = typer.Option(
        0.0, "--kl-weight", help="Distillation: weight of a KL term to the target's own next-token distribution (0: off)."
    ),
    kl_temperature: float = typer.Option(1.0, "--kl-temperature", help="Temperature of both distributions in the KL term."),
    miss_anchors: float = typer.Option(
        0.0, "--miss-anchors",
        help="Fraction of a sequence's blocks anchored where generation starts one: right after a miss of the "
        "drafter on that sequence's previous visit (0: uniform anchors only).",
    ),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Max gradient norm."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    held_out: int = typer.Option(16, "--held-out", help="The last N sequences (of the last --data) are held out for evaluation."),
    eval_every: int = typer.Option(200, "--eval-every", help="Evaluate every N steps (0 = never)."),
    save_every: int = typer.Option(200, "--save-every", help="Checkpoint every N steps (0 = only the end)."),
    cache_features: bool = typer.Option(False, "--cache-features", help="Compute target features once, keep them in OUT/features."),
    features_dir: Optional[Path] = typer.Option(
        None, "--features-dir",
        help="Cache target features here instead of OUT/features (implies --cache-features); runs on the same data "
        "and --target-layer-ids can share it.",
    ),
    resume: bool = typer.Option(
        False, "--resume",
        help="Continue from the newest checkpoint in OUT/checkpoints; --steps, --lr and the other run settings must match.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete an earlier run in OUT (checkpoints, cached features, drafter) and start afresh."
    ),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Train a DFlash drafter for a frozen target, on data from `dflash data`.

    OUT must not hold an earlier run unless --resume or --overwrite is given. Each
    checkpoint (OUT/checkpoints/step_N) is a drafter that loads with --draft-model.

    \b
    Example:
      dflash train --model Qwen/Qwen3-4B --data data/ --out my-drafter --layers 2 --steps 5000
      dflash generate --model Qwen/Qwen3-4B --draft-model my-drafter -p "Hello"

    \b
    One drafter for block sizes 4, 8 and 16, distilled from the target's distribution:
      dflash train --model Qwen/Qwen3-4B --data data/ --out my-drafter --block-sizes 4,8,16 --kl-weight 1
    """
    args = dict(locals())
    guard(lambda: _train(**args))


# Over 60 lines: one training run's wiring; split after the hardening work lands
def _train(model, data_dirs, out, layers, block_size, block_sizes, target_layer_ids, mask_token_id, intermediate_size,
           steps, lr, warmup, grad_accum, anchors, anchor_chunk, gamma, kl_weight, kl_temperature, miss_anchors,
           grad_clip, dtype, held_out, eval_every, save_every, cache_features, features_dir, resume, overwrite, seed) -> None:
    from dflash_mlx import InputError, load
    from dflash_mlx.train.data import load_sequences
    from dflash_mlx.train.trainer import TrainConfig, Trainer, check_fresh_out, init_drafter, pick_mask_token

    from .common import check_out_folder

    # Flags first, then the folders, then the target: a bad value is reported at once.
    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"--dtype must be float32 or bfloat16, got {dtype}")
    ids = parse_numbers(target_layer_ids, "--target-layer-ids", int)
    sizes = parse_numbers(block_sizes, "--block-sizes", int)
    gammas = parse_numbers(gamma, "--gamma", float)
    for flag, value, least in (("--layers", layers, 1), ("--block-size", block_size, 2),
                               ("--mask-token-id", mask_token_id, 0), ("--intermediate-size", intermediate_size, 1),
                               *(("--target-layer-ids", i, 0) for i in ids or ())):
        check_number(flag, value, at_least=least)
    config = TrainConfig(steps=steps, grad_accum=grad_accum, anchors=anchors, anchor_chunk=anchor_chunk, lr=lr,
                         warmup=warmup, grad_clip=grad_clip, gamma=gammas[0] if gammas and len(gammas) == 1 else gammas,
                         dtype=dtype, seed=seed, eval_every=eval_every, eval_sequences=held_out, save_every=save_every,
                         block_sizes=sizes, kl_weight=kl_weight, kl_temperature=kl_temperature,
                         miss_anchors=miss_anchors)
    config.check()
    check_out_folder(out)
    if sizes and block_size is not None and block_size != max(sizes):
        raise InputError(f"--block-size {block_size}: the drafter's block size is the largest of --block-sizes "
                         f"({max(sizes)}); leave --block-size out")
    block_size = max(sizes) if sizes else block_size or 16
    if resume and overwrite:
        raise InputError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    if not resume and not overwrite:
        check_fresh_out(out)  # before loading anything; --overwrite deletes only once the rest is checked
    pair = load(model)
    sequences = [seq for folder in data_dirs for seq in load_sequences(folder)]
    n_held = min(held_out, len(sequences) // 2)
    train_seqs, eval_seqs = sequences[: len(sequences) - n_held], sequences[len(sequences) - n_held:]
    config = replace(config, eval_sequences=n_held)
    features = features_dir or (out / "features" if cache_features else None)
    if resume:
        trainer = Trainer.resume(pair.target, train_seqs, config, out, eval_seqs, features)
        if trainer.rebuilding:
            console.print(f"the run had finished, but {trainer.rebuilding}: writing the drafter again",
                          soft_wrap=True, markup=False, highlight=False)
    else:
        check_fresh_out(out, overwrite)
        mask = mask_token_id if mask_token_id is not None else pick_mask_token(pair.tokenizer, pair.target.vocab_size, sequences)
        drafter = init_drafter(pair.target, mask, layers, block_size, ids, intermediate_size, seed)
        trainer = Trainer(drafter, pair.target, train_seqs, config, out, eval_seqs, features)
    a = trainer.drafter.args
    plan = ", ".join(f"{b} (gamma {g:g})" for b, g in trainer.plan.items())
    distill = f"; KL weight {kl_weight:g} at T={kl_temperature:g}" if kl_weight else ""
    console.print(f"drafter: {a.num_hidden_layers} layer(s), hidden {a.hidden_size}, MLP {a.intermediate_size}, "
                  f"block {a.block_size}, target_layer_ids {a.target_layer_ids}, mask {a.mask_token_id}; "
                  f"trained at block sizes {plan}{distill}; {len(train_seqs)} train / {n_held} held-out sequences")
    try:
        progress = _progress()
        task = progress.add_task("training", total=steps, completed=trainer.step, status="")
        live = Live(Group(progress), console=console, refresh_per_second=4) if console.is_terminal else None
        evaluated = None  # a log (not a terminal) gets one line per evaluation, and the last table at the end
        with live or nullcontext():
            for info in trainer.run():
                progress.update(task, completed=info.step,
                                status=f"loss {info.loss:.3f} lr {info.lr:.2e} {info.tokens_per_s:,.0f} tok/s")
                if info.eval:
                    evaluated = info
                    if live is not None:
                        live.update(Group(progress, fitted(eval_table(info.step, info.eval), console.width)))
                    console.print(eval_line(info.step, info.eval), highlight=False)
    except KeyboardInterrupt:
        console.print(interrupted_note(out, trainer.step, save_every), soft_wrap=True, markup=False,
                      highlight=False)  # paths stay whole, for copying
        raise typer.Exit(130)
    if live is None and evaluated is not None:
        print_table(eval_table(evaluated.step, evaluated.eval), console)
    console.print(f"wrote drafter to {out}", soft_wrap=True, highlight=False)


def parse_numbers(value: Optional[str], flag: str, kind=int) -> Optional[list]:
    """A comma list of numbers (``4,8,16``), or None when the flag is not given.

    Raises:
        InputError: an entry that is not a number of that kind.
    """
    from dflash_mlx import InputError

    if value is None:
        return None
    try:
        numbers = [kind(x) for x in value.split(",")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise InputError(f"{flag} must be comma-separated {what}, got {value!r}") from None
    return numbers


def eval_line(step: int, result: dict) -> str:
    """``step N: held-out tau 4.12 at B=16 (as generated 3.40; acceptance by position .90 .80 ...), ...``:
    the teacher-forced figures of :func:`dflash_mlx.stats.teacher_forced`, per block size, and
    tau along generation's own schedule (:mod:`dflash_mlx.train.chained`) where measured."""
    parts = [f"{r['tau']:.2f} at B={b} (" + (f"as generated {r['tau_generation']:.2f}; " if "tau_generation" in r else "")
             + "acceptance by position " + " ".join(f"{x:.2f}" for x in r["acceptance"]) + ")"
             for b, r in result.items()]
    return f"step {step}: held-out tau " + ", ".join(parts)


def eval_table(step: int, result: dict) -> Table:
    """The latest held-out evaluation: tau and acceptance by block position, per block size."""
    width = max(len(r["acceptance"]) for r in result.values())
    table = Table(title=f"held-out acceptance at step {step} (teacher forced)", title_justify="left")
    table.add_column("B", justify="right")
    table.add_column("tau", justify="right")
    table.add_column("as generated", justify="right")
    for k in range(1, width + 1):
        table.add_column(str(k), justify="right")
    for b, r in result.items():
        cells = [f"{x:.2f}" for x in r["acceptance"]]
        generated = f"{r['tau_generation']:.2f}" if "tau_generation" in r else ""
        table.add_row(str(b), f"{r['tau']:.2f}", generated, *cells, *[""] * (width - len(cells)))
    return table


def interrupted_note(out: Path, step: int, save_every: int) -> str:
    """Where an interrupted run stands: its newest checkpoint, how to use and resume it."""
    from dflash_mlx.train.trainer import Trainer

    ckpts = Trainer.checkpoints(out)
    if not ckpts:
        return (f"interrupted after step {step}, before the first checkpoint (--save-every {save_every}): "
                "nothing was saved")
    return (f"interrupted after step {step}. The newest checkpoint is {ckpts[-1]}: it loads with "
            f"--draft-model {ckpts[-1]}, and --resume continues the run from it.")
