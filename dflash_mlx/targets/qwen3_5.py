"""Qwen3.5 / Qwen3.6 targets (``qwen3_5``): Gated-DeltaNet and gated-attention layers."""

from typing import Tuple

import mlx.core as mx
import mlx.nn as nn

from .hybrid import HybridAdapter


class Qwen35Adapter(HybridAdapter):
    """mlx_lm.models.qwen3_5: separate q/k/v, z, b and a input projections."""

    def project(self, gdn: nn.Module, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        B, S, _ = x.shape
        qkv = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
        return qkv, z, gdn.in_proj_b(x), gdn.in_proj_a(x)


MODEL_TYPES = {"qwen3_5": Qwen35Adapter}
