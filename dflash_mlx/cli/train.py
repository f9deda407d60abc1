"""``dflash data`` (regenerate responses with the target) and ``dflash train``."""

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, List, Optional

import typer
from typer import Option
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from dflash_mlx.errors import InputError
from dflash_mlx.ranges import check_number

from .common import bars, check_out_folder, fitted, guard, load_pair, parse_template_config, print_table

console = Console(stderr=True)


Target = Annotated[str, Option("--model", help="Target: local mlx-lm folder or HF repo id (frozen).")]
Seed = Annotated[int, Option("--seed", help="PRNG seed.")]


def data(
    model: Target,
    out: Annotated[Path, Option("--out", help="Data folder (shards + manifest). Re-running resumes.")],
    prompts: Annotated[List[Path], Option("--prompts", help=(
        "JSONL of {'prompt': ...} or {'messages': [...]} rows; repeatable."))] = [],
    text: Annotated[List[Path], Option("--text", help=(
        "Plain text cut into prompts (documents split by blank lines); repeatable."))] = [],
    self_prompts: Annotated[int, Option("--self-prompts", help="Also sample N openings from the target.")] = 0,
    self_prompt_tokens: Annotated[int, Option("--self-prompt-tokens", help="Tokens sampled per opening.")] = 32,
    self_prompt_style: Annotated[str, Option("--self-prompt-style", help=(
        "prefix (BOS + the sampled tokens), sentence (words from inside them) or chat (a user turn the "
        "target writes where its chat template starts one, asked in the template)."))] = "prefix",
    chat_template_config: Annotated[Optional[str], Option("--chat-template-config", help=(
        "JSON for the chat template; match later use."))] = None,
    max_tokens: Annotated[int, Option("--max-tokens", help="Response tokens per prompt.")] = 256,
    max_length: Annotated[Optional[int], Option("--max-length", help=(
        "Most tokens per sequence (default: 3072 or the target's context if smaller)."))] = None,
    temp: Annotated[float, Option("--temp", help="Regeneration temperature (0 = greedy).")] = 0.0,
    batch_size: Annotated[int, Option("--batch-size", help="Sequences generated together.")] = 32,
    shard_size: Annotated[int, Option("--shard-size", help="Prompts per shard.")] = 256,
    target_layer_ids: Annotated[Optional[str], Option("--target-layer-ids", help=(
        "Also keep the target's features of these layers (comma list, as `dflash train` will use) in "
        "OUT/features, captured as the target generates: training then skips computing them."))] = None,
    seed: Seed = 0,
) -> None:
    """Regenerate responses with the target itself, into resumable shards.

    \b
    Example:
      dflash data --model Qwen/Qwen3-4B --prompts prompts.jsonl --out data/
    """
    o = SimpleNamespace(**locals())
    guard(lambda: _data(o))


def _data(o) -> None:
    check_lengths(o.max_tokens, o.max_length, None)  # flags first, then the 2-3 s of imports
    for flag, value, least in (("--self-prompts", o.self_prompts, 0), ("--self-prompt-tokens", o.self_prompt_tokens, 1),
                               ("--temp", o.temp, 0), ("--batch-size", o.batch_size, 1),
                               ("--shard-size", o.shard_size, 1)):
        check_number(flag, value, at_least=least)
    check_number("--seed", o.seed, at_least=0, at_most=2**63 - 1)  # seed + i seeds the i-th batch
    layer_ids = parse_numbers(o.target_layer_ids, "--target-layer-ids", int)
    for i in layer_ids or ():
        check_number("--target-layer-ids", i, at_least=0)
    check_out_folder(o.out)
    if not (o.prompts or o.text or o.self_prompts):
        raise InputError("no prompt source: give --prompts FILE, --text FILE or --self-prompts N")
    template = parse_template_config(o.chat_template_config)
    import numpy as np

    from dflash_mlx.prompt import context_length
    from dflash_mlx.train.data import encode_prompts, prompts_from_text, read_prompt_file, regenerate
    from dflash_mlx.train.data import response_end_token, self_prompts as sample_openings

    pair = load_pair(o.model, None, defaults=False)
    max_length = check_lengths(o.max_tokens, o.max_length, context_length(pair.target))
    keep = None
    if layer_ids:
        from dflash_mlx.train.features import FOLDER, FeatureStore

        if max(layer_ids) >= pair.target.num_layers:
            raise InputError(f"--target-layer-ids {o.target_layer_ids}: the target has layers "
                             f"0..{pair.target.num_layers - 1}")
        store = FeatureStore(o.out / FOLDER, pair.target, layer_ids, write=True)
        if store.mismatch:
            raise InputError(f"{store.mismatch}; pass the same --target-layer-ids or a new --out")
        keep = store.put
    rng = np.random.default_rng(o.seed)
    rows = [row for path in o.prompts for row in read_prompt_file(path)]
    rows += [row for path in o.text for row in prompts_from_text(path, rng)]
    ids = encode_prompts(pair.tokenizer, rows, template)
    ends = [response_end_token(pair.tokenizer, templated=True)] * len(ids)  # openings are never templated
    if o.self_prompts:
        with console.status(f"sampling {o.self_prompts} openings from the target"):
            openings = sample_openings(pair.model, pair.tokenizer, o.self_prompts, o.self_prompt_tokens, o.seed,
                                       style=o.self_prompt_style, template=template)
        ids += openings
        templated = o.self_prompt_style == "chat"
        ends += [response_end_token(pair.tokenizer, templated=templated)] * len(openings)
    target_id = str(Path(o.model).resolve() if Path(o.model).is_dir() else o.model)  # any cwd resumes
    said = [0]

    def update(done: int, total: int) -> None:  # a log (not a terminal) gets a line per shard
        progress.update(task, completed=done)
        if not console.is_terminal and (done - said[0] >= o.shard_size or done == total > said[0]):
            said[0] = done
            console.print(f"regenerated {done}/{total} sequences ({progress.tasks[0].elapsed:,.0f} s)")

    with bars(console, status=True) as progress:
        task = progress.add_task("regenerating", total=len(ids), status="")
        regenerate(pair.target, pair.tokenizer, ids, o.out, max_tokens=o.max_tokens, max_length=max_length,
                   temp=o.temp, shard_size=o.shard_size, batch_size=o.batch_size, seed=o.seed, target_id=target_id,
                   end_tokens=ends, progress=update, keep_features=keep, capture=layer_ids)
    console.print(f"wrote {len(ids)} sequences to {o.out}")


def check_lengths(max_tokens: int, max_length: Optional[int], context: Optional[int]) -> int:
    """``--max-length`` or its default (3072, at most the context); InputError naming the flag out of range."""
    check_number("--max-tokens", max_tokens, at_least=1)
    check_number("--max-length", max_length, at_least=2)
    if context is not None and max_tokens >= context:
        raise InputError(f"--max-tokens {max_tokens} does not fit the target's context of {context} tokens "
                         "(max_position_embeddings) with a prompt")
    if context is not None and max_length is not None and max_length > context:
        raise InputError(f"--max-length {max_length} is past the target's context of {context} tokens "
                         "(max_position_embeddings)")
    return max_length if max_length is not None else min(3072, context or 3072)


def train(
    model: Target,
    data_dirs: Annotated[List[Path], Option("--data", help="Folder made by `dflash data`; repeatable.")],
    out: Annotated[Path, Option("--out", help="Drafter folder; checkpoints go in OUT/checkpoints.")],
    layers: Annotated[Optional[int], Option("--layers", help=(
        "Drafter layers (default 1; with --init its own, or more: added layers start as identities)."))] = None,
    block_size: Annotated[Optional[int], Option("--block-size", help=(
        "The drafter's block size B (default 16, or the largest of --block-sizes)."))] = None,
    block_sizes: Annotated[Optional[str], Option("--block-sizes", help=(
        "Train at several block sizes, one drawn per sequence, e.g. 4,8,16."))] = None,
    target_layer_ids: Annotated[Optional[str], Option("--target-layer-ids", help=(
        "Target layers whose hidden states the drafter reads, e.g. 1,9,17 (default: spread evenly)."))] = None,
    mask_token_id: Annotated[Optional[int], Option("--mask-token-id", help="MASK id; default: an unused id.")] = None,
    intermediate_size: Annotated[Optional[int], Option("--intermediate-size", help="MLP width (the target's)")] = None,
    init: Annotated[Optional[str], Option("--init", help=(
        "Start from this drafter's weights (a folder --draft-model loads; quantized layers dequantized), keeping "
        "its shape: --layers, --block-size, --target-layer-ids, --mask-token-id, --intermediate-size can go."))] = None,
    arch: Annotated[str, Option("--arch", help=(
        "dflash, or dspark (DeepSeek's: every row drafts, a Markov head biases it by the token before)."))] = "dflash",
    markov_rank: Annotated[Optional[int], Option("--markov-rank", help=(
        "With --arch dspark: the Markov head's rank r, 2 x vocabulary x r weights (default 256; 0: no head)."))] = None,
    confidence_head: Annotated[bool, Option("--confidence-head", help="With --arch dspark: train one too.")] = False,
    l1_weight: Annotated[float, Option("--l1-weight", help="L1 weight toward the target's distribution")] = 0.0,
    steps: Annotated[int, Option("--steps", help="Optimizer steps.")] = 1000,
    lr: Annotated[float, Option("--lr", help="Peak AdamW learning rate.")] = 6e-4,
    warmup: Annotated[float, Option("--warmup", help="Warm-up fraction of the steps, then cosine decay.")] = 0.04,
    grad_accum: Annotated[int, Option("--grad-accum", help="Sequences per step (mlx.launch's ranks share them).")] = 4,
    anchors: Annotated[int, Option("--anchors", help="Blocks sampled per sequence.")] = 512,
    anchor_chunk: Annotated[int, Option("--anchor-chunk", help="Blocks per forward/backward pass (0: all).")] = 64,
    gamma: Annotated[Optional[str], Option("--gamma", help=(
        "Loss decay over block rows, one or one per --block-sizes (default 7 at B=16, 4 at B<=8)."))] = None,
    kl_weight: Annotated[float, Option("--kl-weight", help="KL weight toward the target's distribution")] = 0.0,
    kl_temperature: Annotated[float, Option("--kl-temperature", help="Temperature of the KL term.")] = 1.0,
    miss_anchors: Annotated[float, Option("--miss-anchors", help="Share of blocks anchored after misses")] = 0.0,
    loss_vocab: Annotated[str, Option("--loss-vocab", help=(
        "full: the softmax over the whole vocabulary; data: over the data's tokens and 4,096 others drawn each "
        "step (a sampled softmax, cheaper where the head dominates); step: each step's targets and 4,096."))] = "full",
    draft_vocab: Annotated[int, Option("--draft-vocab", help="Draft among the data's K commonest tokens (0: all).")] = 0,
    grad_clip: Annotated[float, Option("--grad-clip", help="Max gradient norm.")] = 1.0,
    dtype: Annotated[str, Option("--dtype", help="float32 or bfloat16.")] = "float32",
    held_out: Annotated[int, Option("--held-out", help="Sequences held out for evaluation (of the last --data).")] = 16,
    eval_every: Annotated[int, Option("--eval-every", help="Evaluate every N steps (0 = never).")] = 200,
    save_every: Annotated[int, Option("--save-every", help="Checkpoint every N steps (0 = only the end).")] = 200,
    features_dir: Annotated[Optional[Path], Option("--features-dir", help=(
        "Keep the target's features here, computed once (a folder runs at the same layers share)."))] = None,
    resume: Annotated[bool, Option("--resume", help="Continue from the newest checkpoint (same settings).")] = False,
    overwrite: Annotated[bool, Option("--overwrite", help="Delete an earlier run in OUT and start afresh.")] = False,
    seed: Seed = 0,
) -> None:
    """Train a DFlash drafter for a frozen target, on data from `dflash data`.

    Each checkpoint (OUT/checkpoints/step_N) loads with --draft-model.

    \b
    Examples:
      dflash train --model Qwen/Qwen3-4B --data data/ --out my-drafter --layers 2 --steps 5000
      dflash train --model Qwen/Qwen3-4B --data data/ --out my-drafter --block-sizes 4,8,16 --kl-weight 1
    """
    o = SimpleNamespace(**locals())
    guard(lambda: _fit(o, _trainer(o)))


def _config(o):
    """The checked TrainConfig of the flags (InputError naming one); sets ``o.block_size`` and ``o.ids``."""
    from dflash_mlx.train.trainer import TrainConfig

    if o.dtype not in ("float32", "bfloat16"):
        raise InputError(f"--dtype must be float32 or bfloat16, got {o.dtype}")
    if o.arch not in ("dflash", "dspark") or (o.arch != "dspark" and (o.markov_rank is not None or o.confidence_head)):
        raise InputError(f"--arch {o.arch}: give dflash or dspark (--markov-rank and --confidence-head go with "
                         "dspark only)")
    o.rank = (256 if o.markov_rank is None else o.markov_rank) if o.arch == "dspark" else None  # None: v1
    o.ids = parse_numbers(o.target_layer_ids, "--target-layer-ids", int)
    sizes = parse_numbers(o.block_sizes, "--block-sizes", int)
    gammas = parse_numbers(o.gamma, "--gamma", float)
    for flag, value, least in (("--layers", o.layers, 1), ("--block-size", o.block_size, 2),
                               ("--mask-token-id", o.mask_token_id, 0), ("--intermediate-size", o.intermediate_size, 1),
                               ("--markov-rank", o.markov_rank, 0),
                               *(("--target-layer-ids", i, 0) for i in o.ids or ())):
        check_number(flag, value, at_least=least)
    config = TrainConfig(steps=o.steps, grad_accum=o.grad_accum, anchors=o.anchors, anchor_chunk=o.anchor_chunk,
                         lr=o.lr, warmup=o.warmup, grad_clip=o.grad_clip, dtype=o.dtype, seed=o.seed,
                         gamma=gammas[0] if gammas and len(gammas) == 1 else gammas, eval_every=o.eval_every,
                         eval_sequences=o.held_out, save_every=o.save_every, block_sizes=sizes, kl_weight=o.kl_weight,
                         kl_temperature=o.kl_temperature, miss_anchors=o.miss_anchors, loss_vocab=o.loss_vocab,
                         init=o.init, l1_weight=o.l1_weight, draft_vocab=o.draft_vocab)
    config.check()
    check_out_folder(o.out)
    if sizes and o.block_size is not None and o.block_size != max(sizes):
        raise InputError(f"--block-size {o.block_size}: the drafter's block size is the largest of --block-sizes "
                         f"({max(sizes)}); leave --block-size out")
    o.block_size = max(sizes) if sizes else o.block_size
    if o.resume and o.overwrite:
        raise InputError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    return config


def _trainer(o):
    """The :class:`~dflash_mlx.train.trainer.Trainer` of the flags: resumed, or a new drafter."""
    from dflash_mlx.train.data import load_sequences, pick_mask_token
    from dflash_mlx.train.features import FOLDER
    from dflash_mlx.train.trainer import Trainer, check_fresh_out
    from dflash_mlx.train.start import init_drafter, warm_start
    from dflash_mlx.pair.sharded import join_ranks, rank

    config = _config(o)
    join_ranks(None)  # under mlx.launch: data parallel, rank 0 alone prints
    if not o.resume and not o.overwrite:
        check_fresh_out(o.out)  # before loading anything; --overwrite deletes only once the rest is checked
    pair = load_pair(o.model, None, defaults=False)
    sequences = [seq for folder in o.data_dirs for seq in load_sequences(folder)]
    n_held = min(o.held_out, len(sequences) // 2)
    train_seqs, eval_seqs = sequences[: len(sequences) - n_held], sequences[len(sequences) - n_held:]
    config, o.counts = replace(config, eval_sequences=n_held), (len(train_seqs), n_held)
    features = o.features_dir
    kept = [d / FOLDER for d in o.data_dirs if (d / FOLDER).is_dir()]  # dflash data --target-layer-ids
    if o.resume:
        trainer = Trainer.resume(pair.target, train_seqs, config, o.out, eval_seqs, features, kept)
        if trainer.rebuilding:
            console.print(f"the run had finished, but {trainer.rebuilding}: writing the drafter again",
                          soft_wrap=True, markup=False, highlight=False)
        return trainer
    if o.init:
        drafter = warm_start(o.init, pair.target, o.layers, o.rank, o.confidence_head)
        check_init_shape(o, drafter)
    else:
        mask = o.mask_token_id if o.mask_token_id is not None else pick_mask_token(
            pair.tokenizer, pair.target.vocab_size, sequences)
        drafter = init_drafter(pair.target, mask, o.layers or 1, o.block_size or 16, o.ids, o.intermediate_size, o.seed,
                               o.rank, o.confidence_head)
    if rank() == 0:
        check_fresh_out(o.out, o.overwrite)  # deletes an earlier run only now, with everything checked
    return Trainer(drafter, pair.target, train_seqs, config, o.out, eval_seqs, features, kept)


def check_init_shape(o, drafter) -> None:
    """InputError naming the first shape flag that disagrees with the --init drafter's own value."""
    args = drafter.args
    if o.block_size is not None and o.block_size > drafter.block_size:
        raise InputError(f"--block-size(s) {o.block_size}: past the --init drafter {o.init}'s block size "
                         f"{drafter.block_size}")
    if args.format.anchor_first != (o.rank is not None):
        raise InputError(f"--arch {o.arch}: the --init drafter {o.init} is a {args.architecture}; pass --arch "
                         f"{'dspark' if args.format.anchor_first else 'dflash'}")
    given = (("--target-layer-ids", o.ids, args.target_layer_ids),
             ("--mask-token-id", o.mask_token_id, args.mask_token_id),
             ("--intermediate-size", o.intermediate_size, args.intermediate_size),
             ("--markov-rank", o.markov_rank, args.markov_rank),
             ("--confidence-head", o.confidence_head or None, args.enable_confidence_head))
    for flag, value, its in given:
        if value is not None and value != its:
            raise InputError(f"{flag} {value}: the --init drafter {o.init} has {its}; leave {flag} out")


def _fit(o, trainer) -> None:
    """Run the training with a progress bar and the held-out evaluations; Ctrl-C says where the run stands."""
    a = trainer.drafter.args
    plan = ", ".join(f"{b} (gamma {g:g})" for b, g in trainer.plan.items())
    distill = f"; KL weight {o.kl_weight:g} at T={o.kl_temperature:g}" if o.kl_weight else ""
    from dflash_mlx.train.health import lr_warning
    from dflash_mlx.pair.sharded import lockstep, ranks

    markov = f", Markov rank {a.markov_rank}" if a.format.anchor_first else ""
    console.print(f"drafter: {a.architecture}, {a.num_hidden_layers} layer(s), hidden {a.hidden_size}, MLP "
                  f"{a.intermediate_size}{markov}, block {trainer.drafter.block_size}, target_layer_ids "
                  f"{a.target_layer_ids}, mask {a.mask_token_id}; trained at block sizes {plan}{distill}; "
                  f"{o.counts[0]} train / {o.counts[1]} held-out sequences"
                  + (f"; {ranks()} ranks share each step's {o.grad_accum}" if ranks() > 1 else ""))
    for why in trainer.features.unused:
        console.print(f"warning: {why}: the target's features are computed instead", markup=False, highlight=False)
    if too_high := lr_warning(o.lr, a.hidden_size):
        console.print(f"warning: {too_high}", markup=False, highlight=False)
    try:
        progress = bars(console, status=True)
        task = progress.add_task("training", total=o.steps, completed=trainer.step, status="")
        live = Live(Group(progress), console=console, refresh_per_second=4) if console.is_terminal else None
        evaluated = None  # a log (not a terminal) gets one line per evaluation, and the last table at the end
        health, warned = "", False  # the collapse is warned about once
        with live or nullcontext():
            for info in lockstep(trainer.run()):
                if info.health is not None:
                    health = f" rms {info.health.rms:,.1f} cos {info.health.row_cosine:.2f}"
                    collapsing = info.health.warning(o.lr)
                    if collapsing and not warned:
                        warned = True
                        console.print(f"warning: step {info.step}: {collapsing}", markup=False, highlight=False)
                status = f"loss {info.loss:.3f} lr {info.lr:.2e}{health} {info.tokens_per_s:,.0f} tok/s"
                progress.update(task, completed=info.step, status=status)
                if live is None and (info.step % (o.save_every or 100) == 0 or info.step == o.steps):
                    console.print(f"step {info.step}/{o.steps}: {status} ({progress.tasks[0].elapsed:,.0f} s)",
                                  highlight=False)  # a log (not a terminal) gets a line per checkpoint
                if info.eval:
                    evaluated = info
                    if live is not None:
                        live.update(Group(progress, fitted(eval_table(info.step, info.eval), console.width)))
                    console.print(eval_line(info.step, info.eval), highlight=False)
    except KeyboardInterrupt:
        console.print(interrupted_note(o.out, trainer.step, o.save_every), soft_wrap=True, markup=False,
                      highlight=False)  # paths stay whole, for copying
        raise typer.Exit(130)
    if live is None and evaluated is not None:
        print_table(eval_table(evaluated.step, evaluated.eval), console)
    console.print(f"wrote drafter to {o.out}", soft_wrap=True, highlight=False)


def parse_numbers(value: Optional[str], flag: str, kind=int) -> Optional[list]:
    """A comma list of numbers (``4,8,16``) or None; InputError for a bad entry."""
    if value is None:
        return None
    try:
        return [kind(x) for x in value.split(",")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise InputError(f"{flag} must be comma-separated {what}, got {value!r}") from None


def eval_line(step: int, result: dict) -> str:
    """``step N: held-out tau 4.12 at B=16 (as generated 3.40; acceptance by position .90 ...), ...``."""
    def part(b, r) -> str:
        generated = f"as generated {r['tau_generation']:.2f}; " if "tau_generation" in r else ""
        accepted = " ".join(f"{x:.2f}" for x in r["acceptance"])
        return f"{r['tau']:.2f} at B={b} ({generated}acceptance by position {accepted})"

    return f"step {step}: held-out tau " + ", ".join(part(b, r) for b, r in result.items())


def eval_table(step: int, result: dict) -> Table:
    """The latest held-out evaluation: tau and acceptance by block position, per block size."""
    width = max(len(r["acceptance"]) for r in result.values())
    table = Table(title=f"held-out acceptance at step {step} (teacher forced)", title_justify="left")
    for name in ("B", "tau", "as generated", *map(str, range(1, width + 1))):
        table.add_column(name, justify="right")
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
