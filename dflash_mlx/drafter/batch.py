"""One drafter pass for a whole batch of sequences (continuous batching, ``dflash serve``).

Each sequence has its own drafter context (spec section 4: context rows cached, block
rows thrown away), but one step drafts every sequence's block in ONE forward: the
context caches of all sequences are one left-padded mlx-lm ``BatchKVCache`` per
drafter layer. Sequences bring different numbers of new context rows each step (their
own accepted drafts + 1), so every sequence appends the most rows any brings, its
extra rows rolled into its left padding (:class:`dflash_mlx.prompt_cache.batch.RaggedRoll`,
as :func:`~dflash_mlx.prompt_cache.batch.rollback_ragged` does for the target), and each
block attends over its own rows only (a padding mask).

Covers the v1 drafter with full-attention, bidirectional layers and no draft window
(:func:`batch_drafting_refusal` says why another cannot): the per-layer sliding
windows, the DFlash2 convolutions and selector, and ``--draft-window`` would each need
a batched form of their own. Those drafters draft sequence by sequence (lazily, in the
same graph as the verify).

Drafts are the argmax of the same network, computed in one batched graph (its attention
MLX's fused ``scaled_dot_product_attention`` with a padding mask, or on the CPU backend the
attention with the fast exp) rather than per sequence: the last bits may differ, never the
output (the target verifies every draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..kernels import fast_softmax
from ..protocol import Proposal
from .network import compile_enabled
from ..prompt_cache.batch import RaggedRoll, common_padding, extend, keep_rows
from ..targets.fused import rope_rows, rotate


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
        cache: one ``BatchKVCache`` per drafter layer (rows in batch order), or None
            while the batch is empty.
    """

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.cache = None

    def join(self, context: Optional[mx.array], cache: Optional[List[Any]] = None) -> None:
        """Append a sequence as the last row.

        Args:
            context: its prompt's new context rows [1, S, F] (None: S = 0).
            cache: its solo drafter cache already holding the prompt's first rows
                (restored from the prompt cache): ``context`` is appended to it, and it
                is left holding them all (the batch copies it). None: a fresh one.
        """
        solo = cache if cache is not None else self.drafter.make_cache()
        if context is not None:
            self.drafter.ingest(context, solo)
        self.cache = extend(self.cache, solo)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the sequences at ``rows`` (in that order)."""
        self.cache = keep_rows(self.cache, rows)

    def propose(self, tokens: Sequence[mx.array], contexts: Sequence[Optional[mx.array]],
                block_size: int) -> List[Proposal]:
        """Argmax drafts of every sequence, one pass (lazy).

        Args:
            tokens: per sequence, [1] int32 ``t_last``.
            contexts: per sequence, its new context rows [1, S_i, F] or None (S_i = 0).
            block_size: B.

        Returns:
            One :class:`~dflash_mlx.protocol.Proposal` per sequence ([B-1] drafts).
        """
        rows = [0 if c is None else c.shape[1] for c in contexts]
        drafts = self.draft(mx.concatenate(tokens), pad_contexts(contexts, rows), rows, block_size)
        return [Proposal(drafts[i]) for i in range(len(tokens))]

    def draft(self, tokens: mx.array, context: Optional[mx.array], rows: List[int], block_size: int) -> mx.array:
        """:meth:`propose` for a batch held as arrays: the decoder's fast path.

        Args:
            tokens: [N] int32, each sequence's ``t_last``.
            context: [N, S, F] new context rows, sequence i's first ``rows[i]`` real (the
                rest may hold anything finite: they become padding); None when S = 0.
            rows: [N] real rows per sequence.
            block_size: B.

        Returns:
            [N, B-1] int32 argmax drafts (lazy).
        """
        d = self.drafter
        block = mx.concatenate([tokens.reshape(-1, 1).astype(mx.int32),
                                mx.full((tokens.size, block_size - 1), d.args.mask_token_id, dtype=mx.int32)],
                               axis=1)
        h = d.embed_block(block)
        if d.args.input_embedding_scale != 1.0:
            h = h * d.args.input_embedding_scale
        fused = None if context is None else d.hidden_norm(d.fc(context))
        shared = _Shared.of(d, self.cache[0], rows, block_size)
        for layer, c in zip(d.layers, self.cache):
            h = _layer(layer, h, fused, c, shared)
        logits = d.logits(d.norm(h[:, 1:]))
        return mx.argmax(logits, axis=-1).astype(mx.int32)


def pad_contexts(contexts: Sequence[Optional[mx.array]], rows: List[int]) -> Optional[mx.array]:
    """Per-sequence context rows ([1, S_i, F] or None) as one [N, max S, F] array, each
    sequence's rows first, zeros after; None when every S_i is 0."""
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


@dataclass
class _Shared:
    """What every layer of one batched pass shares, built once (the layers' caches have
    one column layout): on a CPU a small drafter's pass costs about its number of ops.

    Attributes:
        rows: [N] new context rows per sequence (``max(rows)`` appended to every cache).
        start: [N] int32 block positions (``t_last`` at the cache's offset + rows).
        roll: rolls each sequence's padding rows among the new ones into its left
            padding, dropping the padding every sequence then has; None when none.
        ctx_rope, block_rope: ``(cos, sin)`` RoPE tables of the new context rows and of
            the block rows (:func:`~dflash_mlx.targets.fused.rope_rows`), or None: each
            layer's own RoPE (a GPU, compiling off, or a RoPE the tables do not cover).
        compiled: the block halves run through :class:`_BatchKernels`.
        visible: [N, L] the columns each sequence sees, set by the first layer.
    """

    rows: List[int]
    start: mx.array
    roll: Optional[RaggedRoll]
    ctx_rope: Optional[Tuple[mx.array, mx.array]]
    block_rope: Optional[Tuple[mx.array, mx.array]]
    compiled: bool
    visible: Optional[mx.array] = None

    @classmethod
    def of(cls, drafter: Any, cache: Any, rows: List[int], block_size: int) -> "_Shared":
        most = max(rows)
        right = [most - r for r in rows]  # each sequence's padding rows among the new ones
        roll = RaggedRoll(right, common_padding(cache, right)) if any(right) else None
        start = cache.offset + mx.array(rows)
        rope = drafter.layers[0].self_attn.rope
        block_rope = rope_rows(rope, block_size, start)
        ctx_rope = rope_rows(rope, most, cache.offset) if most and block_rope is not None else None
        return cls(rows, start, roll, ctx_rope, block_rope, compile_enabled())


def _layer(layer: Any, h: mx.array, fused: Optional[mx.array], cache: Any, shared: _Shared) -> mx.array:
    """One drafter layer over the batch: h [N, B, H] block rows; ``fused`` [N, max S, H]
    new context rows (sequence i's first ``shared.rows[i]`` real) appended to ``cache``,
    then ``shared.roll`` (see :class:`_Shared`)."""
    attn = layer.self_attn
    if shared.compiled:
        kernels = layer.__dict__.get("_batch_kernels")
        if kernels is None:
            kernels = layer.__dict__["_batch_kernels"] = _BatchKernels(layer)
        post = kernels.post
        if shared.block_rope is not None:
            queries, block_keys, block_values = kernels.pre_tables(h, *shared.block_rope)
        else:
            queries, block_keys, block_values = kernels.pre(h, shared.start)
    else:
        post = partial(_post, layer)
        queries, block_keys, block_values = _block_pre(layer, h, shared.start)
    if fused is not None:
        ctx_keys, ctx_values = attn._keys_values(fused)
        if shared.ctx_rope is not None:
            ctx_keys = rotate(ctx_keys, *shared.ctx_rope, attn.rope.traditional)
        else:
            ctx_keys = attn.rope(ctx_keys, offset=cache.offset)
        cache.update_and_fetch(ctx_keys, ctx_values)
        if shared.roll is not None:
            shared.roll(cache)
    ctx_keys, ctx_values = cache.keys_and_values()
    if shared.visible is None:  # block columns: always (padding < context columns)
        shared.visible = mx.arange(ctx_keys.shape[2] + h.shape[1])[None] >= cache.left_padding[:, None]
    out = _attend(attn, queries, ctx_keys, ctx_values, block_keys, block_values, shared.visible)
    return post(h, out)


class _BatchKernels:
    """A drafter layer's compiled halves for a batch (as
    :meth:`~dflash_mlx.drafter.network.DrafterLayer._compiled_step` for one sequence):
    the block rows' norm, projections and RoPE before the attention, the output
    projection and MLP after it. On a CPU a batched step costs about its number of
    small ops, which compiling fuses. Their shapes depend only on the batch size and
    the width, so MLX traces each pair once; the context rows, whose number changes
    every step, stay outside. The layer's parameters are inputs, read at every call.
    Held outside the module tree, so never saved or trained."""

    def __init__(self, layer: Any):
        self.pre = mx.compile(partial(_block_pre, layer), inputs=layer.state)
        self.pre_tables = mx.compile(partial(_block_pre_tables, layer), inputs=layer.state)
        self.post = mx.compile(partial(_post, layer), inputs=layer.state)


def _block_project(layer: Any, h: mx.array, rope: Callable[[mx.array], mx.array]):
    """Block queries [N, n_heads, B, hd] and keys, values [N, n_kv, B, hd], ``rope``
    applied to the queries and keys."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    queries = rope(attn.q_norm(attn._heads(attn.q_proj(x), attn.n_heads)))
    keys, values = attn._keys_values(x)
    return queries, rope(keys), values


def _block_pre(layer: Any, h: mx.array, start: mx.array):
    """:func:`_block_project` with the layer's RoPE at ``start`` [N]."""
    return _block_project(layer, h, lambda x: layer.self_attn.rope(x, offset=start))


def _block_pre_tables(layer: Any, h: mx.array, cos: mx.array, sin: mx.array):
    """:func:`_block_project` with RoPE by the block positions' tables ([N, 1, B, dims]): the same bits."""
    return _block_project(layer, h, lambda x: rotate(x, cos, sin, layer.self_attn.rope.traditional))


def _post(layer: Any, h: mx.array, out: mx.array) -> mx.array:
    """Residual, output projection of ``out`` [N, n_heads, B, hd], then the MLP: [N, B, H]."""
    N, _, B, _ = out.shape
    h = h + layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _attend(attn: Any, queries: mx.array, ctx_keys: mx.array, ctx_values: mx.array, block_keys: mx.array,
            block_values: mx.array, visible: mx.array) -> mx.array:
    """Block queries [N, n_heads, B, hd] over each sequence's cached rows and its whole
    block, the columns ``visible`` [N, L + B] (left padding hidden): MLX's fused
    attention with a padding mask."""
    keys = mx.concatenate([ctx_keys, block_keys], axis=2)
    values = mx.concatenate([ctx_values, block_values], axis=2)
    if fast_softmax.use_fast_exp() and queries.dtype == mx.float32:
        return _attend_fast_exp(queries * attn.scale, keys, values, visible)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale,
                                                mask=visible[:, None, None, :])


def _attend_fast_exp(queries: mx.array, keys: mx.array, values: mx.array, visible: mx.array) -> mx.array:
    """Scaled queries [N, n_heads, B, hd] over keys, values [N, n_kv, L, hd] where
    ``visible`` [N, L]: the attention with :mod:`~dflash_mlx.kernels.fast_softmax`'s exp.
    On MLX's CPU backend the fused attention's exp is most of a drafter pass (about
    1.5x this, per layer, at 100-400 cached rows). Drafts only propose (the target
    verifies them), so the last bits do not matter."""
    N, n_heads, B, hd = queries.shape
    n_kv = keys.shape[1]
    q = queries.reshape(N, n_kv, n_heads // n_kv * B, hd)  # a query group shares its K/V head
    scores = mx.where(visible[:, None, None, :], q @ keys.swapaxes(-1, -2), -mx.inf)
    return (fast_softmax.softmax_any_shape(scores) @ values).reshape(N, n_heads, B, hd)
