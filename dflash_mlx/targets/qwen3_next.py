"""Qwen3-Next targets (``qwen3_next``, Qwen3-Coder-Next): Gated-DeltaNet layers with
interleaved q/k/v/z and b/a projections, gated attention, MoE blocks."""

from typing import Tuple

import mlx.core as mx
import mlx.nn as nn

from .hybrid import HybridAdapter


class Qwen3NextAdapter(HybridAdapter):
    """mlx_lm.models.qwen3_next: the layer's own ``fix_query_key_value_ordering`` splits the fused projections."""

    def project(self, gdn: nn.Module, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        B, S, _ = x.shape
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a


MODEL_TYPES = {"qwen3_next": Qwen3NextAdapter}
