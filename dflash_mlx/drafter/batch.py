"""One drafter pass for a whole batch of sequences (continuous batching, ``dflash serve``).

Each sequence keeps its own context rows (spec section 4) in one left-padded mlx-lm ``BatchKVCache``
per layer. A step appends the most new rows any sequence brings to every sequence, each sequence's
extra rows rolled into its left padding (:class:`~dflash_mlx.targets.batch_cache.RaggedRoll`), and
each block attends over its own columns only. The layer math is the drafter's own
(:class:`~dflash_mlx.drafter.network.DrafterLayer`); only the ``attend`` differs.

Covers v1 drafters with full-attention, bidirectional layers and no draft window
(:func:`batch_drafting_refusal`); the others draft sequence by sequence.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..kernels import fast_softmax
from ..protocol import Proposal
from ..targets.batch_cache import RaggedRoll, common_padding, extend, keep_rows
from .network import KV, Attend, DrafterAttention, masked_attention, positions


def batch_drafting_refusal(drafter: Any) -> Optional[str]:
    """Why ``drafter`` cannot draft a batch in one pass, or None when it can."""
    args = drafter.args
    if args.conv_kernel_size or "candidate_selector" in drafter:
        return f"{args.architecture}: block convolutions or a candidate selector"
    if any(args.is_sliding(i) or args.is_causal_layer(i) for i in range(args.num_hidden_layers)):
        return "sliding-window or causal drafter layers"
    if drafter.draft_window is not None:
        return "a draft window (--draft-window)"
    return None


class BatchDrafts:
    """The drafter's context caches of a batch and its one-pass drafting.

    Args:
        drafter: a bound :class:`~dflash_mlx.drafter.network.DFlashDrafter` that
            :func:`batch_drafting_refusal` accepts.

    Attributes:
        cache: one ``BatchKVCache`` per drafter layer (rows in batch order), or None while the batch is empty.
    """

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.cache = None

    def join(self, context: Optional[mx.array], cache: Optional[List[Any]] = None) -> None:
        """Append a sequence as the last row: its new context rows [1, S, F] (None: S = 0) ingested
        into ``cache`` (its solo drafter cache, e.g. restored from the prompt cache; None: a fresh one)."""
        solo = cache if cache is not None else self.drafter.make_cache()
        if context is not None:
            self.drafter.ingest(context, solo)
        self.cache = extend(self.cache, solo)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the sequences at ``rows`` (in that order)."""
        self.cache = keep_rows(self.cache, rows)

    def propose(self, tokens: Sequence[mx.array], contexts: Sequence[Optional[mx.array]],
                block_size: int) -> List[Proposal]:
        """Argmax drafts ([B-1] each, lazy) of every sequence from its [1] int32 ``t_last`` and its
        new context rows [1, S_i, F] or None, in one pass."""
        rows = [0 if c is None else c.shape[1] for c in contexts]
        drafts = self.draft(mx.concatenate(tokens), pad_contexts(contexts, rows), rows, block_size)
        return [Proposal(drafts[i]) for i in range(len(tokens))]

    def draft(self, tokens: mx.array, context: Optional[mx.array], rows: List[int], block_size: int) -> mx.array:
        """:meth:`propose` for a batch held as arrays.

        Args:
            tokens: [N] int32 ``t_last`` per sequence.
            context: [N, S, F] new context rows, sequence i's first ``rows[i]`` real (the rest finite);
                None when every row count is 0.
            rows: [N] real rows per sequence.
            block_size: B.

        Returns:
            [N, B-1] int32 argmax drafts (lazy).
        """
        d, N, most = self.drafter, tokens.size, max(rows)
        compiled = d.compilable and most <= block_size
        H = d.args.hidden_size
        if context is None:
            fused = mx.zeros((N, 0, H), d.hidden_norm.weight.dtype)
        else:
            fused = d.hidden_norm(d.fc(context[:, :most]))
        if compiled:  # padded to B rows: one trace per batch size and block size
            fused = mx.concatenate([fused, mx.zeros((N, block_size - most, H), fused.dtype)], axis=1)
        offset = self.cache[0].offset
        ctx_at, block_at = positions(d.layers[0].self_attn.rope, offset, offset + mx.array(rows), block_size,
                                     compiled)
        right = [most - r for r in rows]  # each sequence's padding rows among the new ones
        roll = RaggedRoll(right, common_padding(self.cache[0], right)) if any(right) else None
        visible = []  # [N, 1, 1, L + B], made by the first layer: every layer has one column layout
        attends = [_batch_attention(c, most, roll, visible) for c in self.cache]
        hidden = d.forward(d.blocks_of(tokens, block_size), fused, ctx_at, block_at, attends, compiled)
        return mx.argmax(d.logits(hidden), axis=-1).astype(mx.int32)


def _batch_attention(cache: Any, rows: int, roll: Optional[RaggedRoll], visible: list) -> Attend:
    """``attend`` of one layer over the batch: append ``rows`` new context rows to ``cache``, roll,
    then each block over its own cached columns and its block."""

    def attend(attn: DrafterAttention, queries: mx.array, ctx: Optional[KV], block: KV) -> mx.array:
        if rows:
            cache.update_and_fetch(ctx[0][:, :, :rows], ctx[1][:, :, :rows])
            if roll is not None:
                roll(cache)
        keys, values = cache.keys_and_values()
        if not visible:
            columns = mx.arange(keys.shape[2] + queries.shape[2])[None] >= cache.left_padding[:, None]
            visible.append(columns[:, None, None, :])
        return masked_attention(queries, (keys, values), block, visible[0], attn.scale,
                                fast_softmax.softmax_any_shape)

    return attend


def pad_contexts(contexts: Sequence[Optional[mx.array]], rows: List[int]) -> Optional[mx.array]:
    """Per-sequence context rows ([1, S_i, F] or None) as one [N, max S, F] array, each sequence's rows
    first, zeros after; None when every S_i is 0."""
    most = max(rows)
    if most == 0:
        return None
    first = next(c for c in contexts if c is not None)
    padded = []
    for c, r in zip(contexts, rows):
        if r < most:
            pad = mx.zeros((1, most - r, first.shape[2]), first.dtype)
            c = pad if c is None else mx.concatenate([c, pad], axis=1)
        padded.append(c)
    return mx.concatenate(padded, axis=0)
