"""Llama targets: causal masks, plus sliding-window masks where layers use them."""

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from .base import TargetAdapter
from .fused import attention_mask


class LlamaAdapter(TargetAdapter):
    """mlx_lm.models.llama: full and sliding-window layers get their own masks."""

    supports_tree = True

    def layer_windows(self) -> List[Optional[int]]:
        return [self.inner.sliding_window if layer.use_sliding else None for layer in self.layers]

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        inner = self.inner
        full = attention_mask(h, cache[inner.fa_idx])
        if inner.swa_idx is None:
            return [full] * self.num_layers
        window = attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
        return [window if layer.use_sliding else full for layer in self.layers]


MODEL_TYPES = {"llama": LlamaAdapter}
