"""The DFlash drafter: a small block-diffusion model conditioned on target features.

One forward pass ("block denoising", DFLASH_SPEC.md section 4) turns the block
``[t_last, MASK x (B-1)]`` plus the target's new context features into logits for
the B-1 masked positions. Hyper-parameters live in :mod:`dflash_mlx.drafter_config`,
loading and saving the released checkpoint format in :mod:`dflash_mlx.checkpoint`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP  # the same SwiGLU MLP and keys as the checkpoints
from mlx_lm.models.rope_utils import initialize_rope

from .drafter_config import DrafterArgs
from .kernels.block_attention import block_attention


class DrafterAttention(nn.Module):
    """Attention of block queries over cached context K/V plus the block's own K/V.

    Context and block rows share ``k_proj``/``v_proj`` (KV injection, spec section 4).
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        dim, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)

    def _keys_values(self, rows: mx.array):
        """Shared K/V projections of context and block rows: normed keys, values (no RoPE)."""
        keys = self.k_norm(self._heads(self.k_proj(rows), self.n_kv_heads))
        return keys, self._heads(self.v_proj(rows), self.n_kv_heads)

    def ingest(self, context: mx.array, cache: KVCache) -> None:
        """Append context K/V only (no block): [1, S, H] fused rows at ``cache.offset``."""
        keys, values = self._keys_values(context)
        cache.update_and_fetch(self.rope(keys, offset=cache.offset), values)

    def __call__(self, x: mx.array, context: mx.array, cache: KVCache) -> mx.array:
        """Inference: x [1, B, H] block rows; context [1, S, H] new fused context rows."""
        _, B, _ = x.shape
        S = context.shape[1]
        offset = cache.offset
        keys, values = self._keys_values(mx.concatenate([context, x], axis=1))
        queries = self.q_norm(self._heads(self.q_proj(x), self.n_heads))

        queries = self.rope(queries, offset=offset + S)
        block_keys = self.rope(keys[:, :, S:], offset=offset + S)
        ctx_keys, ctx_values = cache.update_and_fetch(
            self.rope(keys[:, :, :S], offset=offset), values[:, :, :S]
        )
        # The Metal kernel where it can run, else the plain-MLX reference (see kernels/).
        out = block_attention(queries, ctx_keys, ctx_values, block_keys, values[:, :, S:], scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))

    def blocks(self, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training: many blocks of one sequence at once (spec section 6).

        Args:
            x: [N, B, H] block rows, block n at positions ``anchors[n] + 0..B-1``.
            context: [1, L, H] fused context rows at positions 0..L-1.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool, True where a query may look (context
                columns first, then the block's own rows).

        Memory: the context K/V ([1, n_kv, L, head_dim]) is shared by every block
        through broadcasting matmuls; ``scaled_dot_product_attention`` would need one
        copy per block (N x L rows). The scores ([N, n_heads, B, L + B], float32)
        are the largest tensor here; callers bound N (the trainer's ``anchor_chunk``).
        """
        N, B, _ = x.shape
        L = context.shape[1]
        group = self.n_heads // self.n_kv_heads
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=anchors)
        block_keys, block_values = self._keys_values(x)
        block_keys = self.rope(block_keys, offset=anchors)
        ctx_keys, ctx_values = self._keys_values(context)
        ctx_keys = self.rope(ctx_keys, offset=0)
        # Row g * B + i: query head kv * group + g, block row i (GQA: a group shares its K/V).
        q = (queries.astype(mx.float32) * self.scale).reshape(N, self.n_kv_heads, group * B, self.head_dim)
        scores = mx.concatenate([q @ ctx_keys.astype(mx.float32).swapaxes(-1, -2),
                                 q @ block_keys.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        visible = mx.broadcast_to(mask[:, :, None], (N, 1, group, B, L + B)).reshape(N, 1, group * B, L + B)
        weights = mx.softmax(mx.where(visible, scores, -mx.inf), axis=-1).astype(x.dtype)
        out = weights[..., :L] @ ctx_values + weights[..., L:] @ block_values  # [N, n_kv, group * B, hd]
        out = out.reshape(N, self.n_heads, B, self.head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


class DrafterLayer(nn.Module):
    """Pre-norm transformer layer: KV-injected attention, then SwiGLU MLP."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.self_attn = DrafterAttention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, context: mx.array, cache: Optional[KVCache] = None,
                 anchors: Optional[mx.array] = None, mask: Optional[mx.array] = None) -> mx.array:
        """Inference with ``cache``; training with ``anchors`` and ``mask`` instead."""
        x = self.input_layernorm(h)
        if cache is not None:
            h = h + self.self_attn(x, context, cache)
        else:
            h = h + self.self_attn.blocks(x, context, anchors, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter network. Embedding and lm_head are borrowed from the target.

    Parameters (checkpoint keys): ``fc`` [H, K*H], ``hidden_norm`` [H],
    ``layers.{i}.*``, ``norm`` [H]. Call :meth:`bind` before use.
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_ctx = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(n_ctx, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DrafterLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._embed: Optional[Callable[[mx.array], mx.array]] = None
        self._lm_head: Optional[Callable[[mx.array], mx.array]] = None

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> List[int]:
        return self.args.target_layer_ids

    def bind(self, embed: Callable[[mx.array], mx.array], lm_head: Callable[[mx.array], mx.array]) -> "DFlashDrafter":
        """Borrow the target's (frozen) embedding and output head.

        Stored as plain callables, so they never appear in ``parameters()``, are
        never saved and are never trained.
        """
        self._embed, self._lm_head = embed, lm_head
        return self

    def make_cache(self) -> List[KVCache]:
        """One context-only KV cache per drafter layer."""
        return [KVCache() for _ in self.layers]

    def __call__(self, block: mx.array, context: mx.array, cache: Sequence[KVCache]) -> mx.array:
        """One block-denoising pass.

        Args:
            block: [1, B] int32, ``[t_last, MASK x (B-1)]``.
            context: [1, S, K*H] new context features (target dtype), the rows at
                positions ``[cache.offset, cache.offset + S)``; ``t_last`` sits at
                ``cache.offset + S``.
            cache: from :meth:`make_cache`; context K/V are appended in place.

        Returns:
            [1, B-1, V] logits for block positions 1..B-1 (row k predicts the
            token at block position k).
        """
        if self._embed is None:
            raise RuntimeError("DFlashDrafter.bind(...) must be called before use")
        h = self._embed(block)
        fused = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            h = layer(h, fused, c)
        return self._lm_head(self.norm(h[:, 1:]))

    def block_logits(self, blocks: mx.array, context: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
        """Training forward over many blocks of one sequence.

        Args:
            blocks: [N, B] int32, each ``[token at anchor, MASK x (B-1)]``.
            context: [1, L, K*H] target features of the whole sequence.
            anchors: [N] int32 anchor positions.
            mask: [N, 1, B, L + B] bool from :func:`dflash_mlx.train.blocks.block_mask`.

        Returns:
            [N, B-1, V] logits for block rows 1..B-1.
        """
        h = self._embed(blocks)
        fused = self.hidden_norm(self.fc(context))
        for layer in self.layers:
            h = layer(h, fused, anchors=anchors, mask=mask)
        return self._lm_head(self.norm(h[:, 1:]))

    def ingest(self, context: mx.array, cache: Sequence[KVCache]) -> None:
        """Cache context rows without drafting, so the drafter covers what the target
        cache covers (used when a generation ends; the next turn continues from it).

        Args:
            context: [1, S, K*H] context features at positions ``[offset, offset+S)``.
        """
        if context.shape[1] == 0:
            return
        fused = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.ingest(fused, c)

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[KVCache], block_size: int) -> mx.array:
        """Greedy drafts for one block.

        Args:
            token: scalar or [1] int, the last committed token ``t_last``.
            context: [1, S, K*H] new context features.
            cache: drafter cache.
            block_size: B, 2 <= B <= trained block size.

        Returns:
            [B-1] int32 draft tokens d_1..d_{B-1} (lazy).
        """
        masks = mx.full((block_size - 1,), self.args.mask_token_id, dtype=mx.int32)
        block = mx.concatenate([token.reshape(1).astype(mx.int32), masks])[None]
        return mx.argmax(self(block, context, cache)[0], axis=-1)
