"""Hybrid targets (``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``): Gated-DeltaNet layers between attention
layers. A Gated-DeltaNet layer runs here as mlx-lm's ``GatedDeltaNet.__call__`` (same bits), handing its
recurrence inputs to its ``GatedDeltaCache`` for rollback (spec section 10); family files give the projections."""

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..prompt_cache.gated_delta import GatedDeltaCache
from .base import TargetAdapter
from ..errors import MismatchError, RollbackError
from .fused import attention_mask


class HybridAdapter(TargetAdapter):
    """Layers with ``is_linear`` run a Gated-DeltaNet (``linear_attn``), the others attention."""

    rollback_spans_forwards = False  # a GatedDeltaCache replays its last forward only

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        inner = self.inner
        fa = attention_mask(h, cache[inner.fa_idx]) if inner.fa_idx is not None else None
        ssm = create_ssm_mask(h, cache[inner.ssm_idx]) if inner.ssm_idx is not None else None
        return [ssm if layer.is_linear else fa for layer in self.layers]

    def run_layers(self, inputs: mx.array, h: mx.array, cache: Sequence[Any]) -> Iterator[mx.array]:
        for layer, c, mask in zip(self.layers, cache, self.masks(h, cache)):
            if layer.is_linear:  # the DecoderLayer's linear branch
                h = h + self.gated_delta_net(layer.linear_attn, layer.input_layernorm(h), mask, c)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, mask, c)
            yield h

    def recurrent_module(self, i: int) -> Optional[nn.Module]:
        """The recurrent (Gated-DeltaNet) module of layer ``i``, None for attention."""
        layer = self.layers[i]
        return layer.linear_attn if layer.is_linear else None

    def exact_cache(self, i: int, c: Any, max_verify: int) -> Any:
        if type(c) is ArraysCache and self.recurrent_module(i) is not None:
            return GatedDeltaCache(self.recurrent_module(i), slack=max_verify)
        return super().exact_cache(i, c, max_verify)

    def check_layer_cache(self, i: int, c: Any, max_verify: int) -> None:
        """A Gated-DeltaNet layer's cache must be a ``GatedDeltaCache`` of this layer with room for ``max_verify``.

        Raises:
            MismatchError: another model's cache (mlx-lm's own ``ArraysCache`` aside).
            RollbackError: mlx-lm's ``ArraysCache``, or too little rollback room.
        """
        owner = self.recurrent_module(i)
        if owner is None:
            return super().check_layer_cache(i, c, max_verify)
        name = type(self).__name__
        if not isinstance(c, GatedDeltaCache):
            if type(c) is ArraysCache:
                raise RollbackError(f"target layer {i}: mlx-lm's ArraysCache (Gated-DeltaNet state) cannot be "
                                    f"rolled back, so speculative decoding would not reproduce the target; "
                                    f"use {name}.make_cache()")
            raise MismatchError(f"target layer {i} is a Gated-DeltaNet layer but its cache is a {type(c).__name__}: "
                                f"it was built for another model; use {name}.make_cache()")
        if c.owner is not owner:
            raise MismatchError(f"target layer {i}: this Gated-DeltaNet cache was built by another model "
                                f"(or for another layer); use {name}.make_cache() of this target")
        if c.slack < max_verify:
            raise RollbackError(f"target layer {i}: Gated-DeltaNet cache can roll back {c.slack} tokens but a "
                                f"verify feeds {max_verify}; build it with make_cache(max_verify={max_verify})")

    def project(self, gdn: nn.Module, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """``(qkv [1, S, conv_dim], z [1, S, Hv, Dv], b [1, S, Hv], a [1, S, Hv])`` of inputs [1, S, H]."""
        raise NotImplementedError

    def gated_delta_net(self, gdn: nn.Module, x: mx.array, mask: Optional[mx.array],
                        cache: GatedDeltaCache) -> mx.array:
        """One Gated-DeltaNet layer (``gdn``: its ``linear_attn``) on [1, S, H] normed inputs -> [1, S, H];
        updates ``cache`` (a ``GatedDeltaCache`` records the forward for rollback)."""
        B, S, _ = x.shape
        qkv, z, b, a = self.project(gdn, x)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(gdn.conv1d(conv_input))
        dims = [(gdn.num_k_heads, gdn.head_k_dim)] * 2 + [(gdn.num_v_heads, gdn.head_v_dim)]
        split = mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1)
        q, k, v = [t.reshape(B, S, heads, dim) for t, (heads, dim) in zip(split, dims)]
        q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
        use_kernel = not gdn.training
        out, state = gated_delta_update(q, k, v, a, b, gdn.A_log, gdn.dt_bias, cache[1], mask, use_kernel=use_kernel)
        if isinstance(cache, GatedDeltaCache):
            cache.store(conv_input, state, q, k, v, a, b, gdn.A_log, gdn.dt_bias, mask, use_kernel)
        else:  # mlx-lm's own ArraysCache (no rollback), updated as the module does
            cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1):, :])
            cache[1] = state
            cache.advance(S)
        out = gdn.norm(out, z)
        return gdn.out_proj(out.reshape(B, S, -1))
