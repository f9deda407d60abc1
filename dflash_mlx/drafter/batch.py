"""One drafter pass for a batch of sequences: each sequence's context rows in one left-padded mlx-lm
``BatchKVCache`` per layer; the drafter's own layers with a padding-masked ``attend``. v1 drafters with
full, bidirectional layers and no draft window only (:func:`drafting_not_batchable`)."""

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..kernels import fast_softmax
from ..prompt_cache.batch import RaggedRoll, common_padding, extend, keep_rows
from ..kernels.block_attention import masked_attention
from .network import KV, Attend, DFlashDrafter, DrafterAttention


def batch_drafts(drafter: Any) -> Optional["BatchDrafts"]:
    """A :class:`BatchDrafts` for ``drafter``; None for anything but a :class:`DFlashDrafter` with a
    batched form (:func:`drafting_not_batchable`), None included."""
    ok = isinstance(drafter, DFlashDrafter) and drafting_not_batchable(drafter) is None
    return BatchDrafts(drafter) if ok else None


def drafting_not_batchable(drafter: Any) -> Optional[str]:
    """Why ``drafter`` cannot draft a batch in one pass, or None when it can."""
    args = drafter.args
    if args.conv_kernel_size or "candidate_selector" in drafter:
        return f"{args.architecture}: block convolutions or a candidate selector"
    if any(args.is_sliding(i) or args.is_causal_layer(i) for i in range(args.num_hidden_layers)):
        return "sliding-window or causal drafter layers"
    return "a draft window (--draft-window)" if drafter.draft_window is not None else None


class BatchDrafts:
    """A bound drafter's context caches of a batch (``cache``: one ``BatchKVCache`` per layer, rows in
    batch order; None while empty) and its one-pass drafting."""

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

    def draft(self, tokens: mx.array, context: Optional[mx.array], rows: List[int], block_size: int) -> mx.array:
        """[N, B-1] int32 greedy drafts (lazy; :meth:`DFlashDrafter.drafts`) from tokens [N] int32 ``t_last`` and new
        context rows [N, S, F], sequence i's first ``rows[i]`` real (the rest finite), or None when all rows are 0."""
        d, most = self.drafter, max(rows)
        if context is None:
            fused = mx.zeros((tokens.size, 0, d.args.hidden_size), d.hidden_norm.weight.dtype)
        else:
            fused = d.hidden_norm(d.fc(context[:, :most]))
        offset = self.cache[0].offset
        right = [most - r for r in rows]  # each sequence's padding rows among the new ones
        roll = RaggedRoll(right, common_padding(self.cache[0], right)) if any(right) else None
        visible = []  # [N, 1, 1, L + B], made by the first layer (all layers have one column layout)
        attends = [_batch_attention(c, most, roll, visible) for c in self.cache]
        hidden = d.forward(d.blocks_of(tokens, block_size), fused, offset, offset + mx.array(rows), attends)
        return d.drafts(hidden, d.logits(hidden), tokens)[0]


def _batch_attention(cache: Any, rows: int, roll: Optional[RaggedRoll], visible: list) -> Attend:
    """``attend`` of one layer: append ``rows`` new context rows to ``cache``, roll the ragged ones into
    the left padding, then each block over its own columns."""

    def attend(attn: DrafterAttention, queries: mx.array, ctx: KV, block: KV) -> mx.array:
        if rows:
            cache.update_and_fetch(ctx[0][:, :, :rows], ctx[1][:, :, :rows])
            if roll is not None:
                roll(cache)
        keys, values = cache.keys_and_values()
        attn.__dict__["path"] = {"block_attention": "reference", "reason": "a batch drafts (masked attention)"}
        if not visible:
            columns = mx.arange(keys.shape[2] + queries.shape[2])[None] >= cache.left_padding[:, None]
            visible.append(columns[:, None, None, :])
        return masked_attention(queries, (keys, values), block, visible[0], attn.scale, fast_softmax.softmax_any_shape)

    return attend


def pad_contexts(contexts: Sequence[Optional[mx.array]], rows: List[int]) -> Optional[mx.array]:
    """Per-sequence context rows ([1, S_i, F] or None) as one [N, max S, F] array, each sequence's rows
    first, zeros after; None when every S_i is 0."""
    most = max(rows)
    if most == 0:
        return None
    first = next(c for c in contexts if c is not None)
    return mx.concatenate([mx.zeros((1, most, first.shape[2]), first.dtype) if c is None
                           else mx.pad(c, [(0, 0), (0, most - r), (0, 0)]) for c, r in zip(contexts, rows)], axis=0)
