"""Tree verification (DDTree, spec section 7): every input token at its own position.

mlx-lm's attention modules rotate the L inputs of one forward at consecutive positions
(``cache.offset + i``), which is a chain. A draft tree puts each node at
``start + depth``, and ``mx.fast.rope`` takes one offset per batch row, not per token,
so a tree verify cannot go through the modules' ``__call__``. For the families that
support trees, a decoder layer is run here from the layer's own modules: projections,
norms and RoPE (one token per batch row, so each gets its own offset), the cache's
update, attention under the tree mask, then the layer's MLP. A test pins this forward
bit for bit to the model's own forward on a chain.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention

from .caches import WindowKVCache


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """[1, H, L, D] rotated by the module's own RoPE with token l at ``positions[l]``."""
    per_token = x.transpose(2, 1, 0, 3)  # [L, H, 1, D]: one batch row, one offset per token
    return rope(per_token, offset=positions).transpose(2, 1, 0, 3)


def attention_at(attn: nn.Module, x: mx.array, cache: Any, positions: mx.array, mask: mx.array) -> mx.array:
    """A llama/qwen3-style attention module on [1, L, H] inputs at ``positions``.

    Same operations as the module's ``__call__`` (q/k/v projections, the per-head q/k
    norms where the module has them, RoPE, the cache update, scaled dot-product
    attention, o_proj), with RoPE per token and ``mask`` [L, P + L] bool.
    """
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = rope_at(attn.rope, queries.transpose(0, 2, 1, 3), positions)
    keys = rope_at(attn.rope, keys.transpose(0, 2, 1, 3), positions)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def decoder_layer_at(layer: nn.Module, h: mx.array, cache: Any, positions: mx.array, mask: mx.array) -> mx.array:
    """A pre-norm decoder layer (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``) with its attention at ``positions``."""
    h = h + attention_at(layer.self_attn, layer.input_layernorm(h), cache, positions, mask)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def tree_layer_mask(cache: Any, positions: np.ndarray, ancestors: np.ndarray,
                    window: Optional[int]) -> mx.array:
    """[L, P + L] bool: every cached row and, inside the tree, the ancestors (and
    itself) of each query; with a sliding ``window`` only keys less than ``window``
    positions back. P is the rows the layer's cache returns before the new ones."""
    held = cache.held if isinstance(cache, WindowKVCache) else cache.offset
    prefix = np.arange(cache.offset - held, cache.offset)
    keys = np.concatenate([prefix, positions])
    visible = np.concatenate([np.ones((len(positions), held), dtype=bool), ancestors], axis=1)
    if window is not None:
        visible &= (positions[:, None] - keys[None, :]) < window
    return mx.array(visible)


def compact_rows(cache: Any, new_rows: int, keep: Sequence[int]) -> int:
    """Of a layer's last ``new_rows`` rows, keep those at ``keep`` (increasing, relative
    to the first new row), in order, and drop the rest.

    Returns:
        Rows dropped, as the cache's ``trim`` reports it.
    """
    base = cache.offset - new_rows - (cache.start if isinstance(cache, WindowKVCache) else 0)
    rows = mx.array([base + k for k in keep], dtype=mx.int32)
    m = len(keep)
    cache.keys[..., base : base + m, :] = mx.take(cache.keys, rows, axis=2)
    cache.values[..., base : base + m, :] = mx.take(cache.values, rows, axis=2)
    return cache.trim(new_rows - m)
