"""Tree verification (DDTree, spec section 7): every input token at its own position.

mlx-lm's attention modules rotate the L inputs of one forward at consecutive positions (``cache.offset + i``), which is
a chain. A draft tree puts each node at ``start + depth``, and ``mx.fast.rope`` takes one offset per batch row, not per
token, so a tree verify cannot go through the modules' ``__call__``. For the families that support trees, a decoder
layer is run here from the layer's own modules: projections, norms and RoPE (one token per batch row, so each gets its
own offset), the cache's update, attention under the tree mask, then the layer's MLP. A test pins this forward bit for
bit to the model's own forward on a chain.

:class:`TreeVerify` holds what an adapter needs for it (the layer walk at per-token positions and the compaction to the
accepted path); every :class:`~dflash_mlx.targets.base.TargetAdapter` has it, and a family turns it on with
``supports_tree = True`` (and :meth:`TreeVerify.layer_windows` where layers slide).
"""

from typing import Any, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from ..prompt_cache.rollback import rollback
from ..prompt_cache.window import WindowKVCache
from ..errors import InputError, RollbackError


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """[1, H, L, D] rotated by the module's own RoPE with token l at ``positions[l]``."""
    per_token = x.transpose(2, 1, 0, 3)  # [L, H, 1, D]: one batch row, one offset per token
    return rope(per_token, offset=positions).transpose(2, 1, 0, 3)


def attention_at(attn: nn.Module, x: mx.array, cache: Any, positions: mx.array, mask: mx.array) -> mx.array:
    """A llama/qwen3-style attention module on [1, L, H] inputs at ``positions``.

    Same operations as the module's ``__call__`` (q/k/v projections, the per-head q/k norms where the module has them,
    RoPE, the cache update, scaled dot-product attention, o_proj), with RoPE per token and ``mask`` [L, P + L] bool.
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


def tree_layer_mask(cache: Any, positions: np.ndarray, ancestors: np.ndarray, window: Optional[int]) -> mx.array:
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


def compact_rows(cache: Any, keep: Sequence[int]) -> None:
    """Of the new rows of a layer rolled back to its first new row plus ``len(keep)``, write those at ``keep``
    (increasing, relative to the first new row) over the kept ones, in order. A ``KVCache`` or
    ``WindowKVCache`` rollback moves only the offset: the rows past it are still in the buffer."""
    m = len(keep)
    base = cache.offset - m - (cache.start if isinstance(cache, WindowKVCache) else 0)
    rows = mx.array([base + k for k in keep], dtype=mx.int32)
    cache.keys[..., base : base + m, :] = mx.take(cache.keys, rows, axis=2)
    cache.values[..., base : base + m, :] = mx.take(cache.values, rows, axis=2)


class TreeVerify:
    """Tree verify for a target adapter (mixed into :class:`~dflash_mlx.targets.base.TargetAdapter`, whose ``layers``
    and ``num_layers`` it uses): its ``__call__`` runs :meth:`run_tree_layers` when given a tree, and the decode loop
    calls :meth:`compact` after each tree step."""

    supports_tree = False  # True where decoder_layer_at runs the family's layers

    def layer_windows(self) -> List[Optional[int]]:
        """Each layer's sliding window in tokens, None for full attention."""
        return [None] * self.num_layers

    def run_tree_layers(self, h: mx.array, cache: Sequence[Any], positions: np.ndarray,
                        ancestors: np.ndarray) -> Iterator[mx.array]:
        """The decoder layers with every input at its own position (see the
        module doc); yields the residual stream per layer."""
        if not self.supports_tree:
            raise InputError(f"tree verification is not available for {type(self).__name__} targets "
                             "(chain verify only)")
        pos = mx.array(positions, dtype=mx.int32)
        for layer, c, window in zip(self.layers, cache, self.layer_windows()):
            h = decoder_layer_at(layer, h, c, pos, tree_layer_mask(c, positions, ancestors, window))
            yield h

    def compact(self, cache: Sequence[Any], new_rows: int, keep: Sequence[int]) -> None:
        """After a tree verify of ``new_rows`` inputs, keep in every layer the rows of the accepted path ``keep``
        (increasing, relative to the first input) and drop the rest, so the cache equals one that only saw the
        path. The path is no prefix of the inputs: :func:`~dflash_mlx.prompt_cache.rollback.rollback` drops the
        last ``new_rows - len(keep)`` rows, then :func:`compact_rows` moves the path's rows into the kept ones.

        Raises:
            RollbackError: a layer cannot drop the rows exactly.
        """
        for i, c in enumerate(cache):
            if not isinstance(c, (KVCache, WindowKVCache)):
                raise RollbackError(f"target layer {i}: {type(c).__name__} cannot keep only the accepted path")
        rollback(cache, [new_rows - len(keep)] * len(cache), "target layer")
        for c in cache:
            compact_rows(c, keep)
