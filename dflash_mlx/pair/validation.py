"""Validation of a converted pair against its sources: the rows of ``dflash convert``'s table."""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step as mlx_lm_generate_step

from ..drafter.checkpoint import load_drafter
from ..drafter.network import DFlashDrafter
from ..decode.generate import generate_step
from .loading import float_dtype, is_quantized, load, quantization
from .manifest import dtype_name
from ..targets import TargetAdapter

VALIDATION_MESSAGES = [{"role": "user", "content": "Write three short sentences about the sea."}]
VALIDATION_TOKENS = 32
FLOAT_TOLERANCE = 1e-5  # relative logit difference of a float drafter of unchanged dtype


@dataclass
class Check:
    """One row of the validation table: ``ok`` True passed, False failed, None measured only (expected to
    differ, e.g. a quantized target's greedy output)."""

    name: str
    result: str
    ok: Optional[bool]


def greedy_tokens(model: nn.Module, prompt: Sequence[int], n: int) -> List[int]:
    """n greedy tokens from mlx-lm's own ``generate_step`` (no stop tokens)."""
    steps = mlx_lm_generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def dflash_tokens(target: TargetAdapter, drafter, prompt: Sequence[int], n: int, stop_token_ids: Sequence[int] = ()):
    """Up to n greedy tokens through DFlash (ending before a stop token), and their statistics."""
    tokens: List[int] = []
    for step in generate_step(mx.array(prompt, dtype=mx.int32), target, drafter, max_tokens=n,
                              stop_token_ids=stop_token_ids):
        tokens += step.tokens
    return tokens, step.stats


def drafter_logits(drafter: DFlashDrafter, target: TargetAdapter, prompt: Sequence[int]) -> mx.array:
    """One drafter forward in float32 (the drafter is cast and bound to ``target`` in place): the prompt's
    context features, the block of a verify of the drafter's whole size after the target's next token
    (:meth:`~dflash_mlx.drafter.network.DFlashDrafter.blocks_of`: ``[token, MASK x (B-1)]``, one MASK fewer
    where row 0 drafts too).

    Returns:
        [B-1, V] float32 logits, one row per draft.
    """
    h, features = target(mx.array(prompt, dtype=mx.int32)[None], target.make_cache(), capture=drafter.target_layer_ids)
    first = mx.argmax(target.lm_head(h[:, -1]), axis=-1).astype(mx.int32)
    block = drafter.blocks_of(first, drafter.block_size)
    drafter.set_dtype(mx.float32)
    drafter.bind(lambda ids: target.embed(ids).astype(mx.float32), lambda x: target.head(x.astype(target.dtype)),
                 target.logit_cap)
    return drafter(block, features.astype(mx.float32), drafter.make_cache())[0].astype(mx.float32)


def logit_difference(converted: mx.array, reference: mx.array) -> Tuple[float, float]:
    """``(max |converted - reference|, that / max |reference|)`` over the finite logits (a reduced draft
    vocabulary's -inf elsewhere)."""
    finite = mx.isfinite(reference)
    diff = mx.where(finite, mx.abs(converted - reference), 0).max().item()
    return diff, diff / max(mx.where(finite, mx.abs(reference), 0).max().item(), 1e-30)


def _agreement(got: List[int], want: List[int]) -> str:
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if same is None and len(got) == len(want):
        return f"{len(want)}/{len(want)} tokens equal"
    return f"{sum(a == b for a, b in zip(got, want))}/{len(want)} tokens equal, first differs at {same}"


@dataclass
class SourceRun:
    """What validation needs from the unconverted target (so it can be released first): the prompt, its
    greedy continuation (mlx-lm's generate_step), the target's shape and float dtype."""

    prompt: List[int]
    tokens: List[int]
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: mx.Dtype

    @classmethod
    def of(cls, source: TargetAdapter, prompt: Sequence[int], n: int = VALIDATION_TOKENS) -> "SourceRun":
        return cls(list(prompt), greedy_tokens(source.model, prompt, n), source.vocab_size,
                   source.hidden_size, source.num_layers, source.dtype)


def validate(root: Path, source: SourceRun, draft_src: Path) -> List[Check]:
    """Check the converted folder ``root`` against the unconverted target's run and drafter folder.

    Rows: vocabulary, hidden size and layers; the converted target's greedy output against the unconverted
    one's (must be equal when unquantized in the same dtype); DFlash's greedy output against the converted
    target's (a difference is reported, not fatal) and tau; the drafters' largest logit difference in float32
    (at most :data:`FLOAT_TOLERANCE` relative for a float drafter of unchanged dtype).
    """
    prompt, n = source.prompt, len(source.tokens)
    pair = load(str(root / "target"), str(root / "drafter"))
    target, args = pair.target, pair.drafter.args
    quantized = is_quantized(target.model)
    float_path = not quantized and target.dtype == source.dtype
    checks = [
        Check("vocabulary", f"target {target.vocab_size}, drafter {args.vocab_size}",
              target.vocab_size == args.vocab_size == source.vocab_size),
        Check("hidden size", f"target {target.hidden_size}, drafter {args.hidden_size}",
              target.hidden_size == args.hidden_size == source.hidden_size),
        Check("layers", f"target {target.num_layers}, drafter reads {list(args.target_layer_ids)}",
              target.num_layers == source.num_layers and max(args.target_layer_ids) < target.num_layers)]
    own = greedy_tokens(target.model, prompt, n)
    why = "" if float_path else ("; quantized, may differ" if quantized
                                 else f"; {dtype_name(source.dtype)} -> {dtype_name(target.dtype)}, may differ")
    checks.append(Check("target vs unconverted", _agreement(own, source.tokens) + why,
                        own == source.tokens if float_path else None))
    tokens, stats = dflash_tokens(target, pair.drafter, prompt, n)
    # A B-row verify and a 1-row decode may round a near-tie differently (spec section 5): not fatal here.
    checks.append(Check("DFlash vs target",
                        f"{_agreement(tokens, own)}; {stats.tau_text()} at block {stats.block_size}",
                        True if tokens == own else None))

    converted = load_drafter(str(root / "drafter"))
    original = load_drafter(str(draft_src))
    exact = not is_quantized(converted) and float_dtype(converted) == float_dtype(original)
    bits = quantization(converted) if is_quantized(converted) else "float"
    diff, rel = logit_difference(drafter_logits(converted, target, prompt), drafter_logits(original, target, prompt))
    checks.append(Check("drafter logits",
                        f"max |diff| {diff:.3g} = {rel:.2%} of max |logit| ({bits}, float32)",
                        rel <= FLOAT_TOLERANCE if exact else None))
    return checks
