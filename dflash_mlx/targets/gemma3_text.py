"""Gemma 3 targets: scaled embeddings, every ``sliding_window_pattern``-th layer global, the others windowed."""

from typing import Any, List, Sequence

import mlx.core as mx

from .base import TargetAdapter
from .fused import attention_mask


class Gemma3TextAdapter(TargetAdapter):
    """mlx_lm.models.gemma3_text."""

    def embed(self, inputs: mx.array) -> mx.array:
        """Embeddings times sqrt(hidden) rounded to bfloat16, as the model does."""
        h = self.inner.embed_tokens(inputs)
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        inner = self.inner
        pattern = inner.sliding_window_pattern
        full = attention_mask(h, cache[pattern - 1])
        window = attention_mask(h, cache[0], window_size=inner.window_size) if pattern > 1 else None
        return [full if i % pattern == pattern - 1 else window for i in range(self.num_layers)]

    def head(self, h: mx.array) -> mx.array:
        return self.inner.embed_tokens.as_linear(h) if self.text.tie_word_embeddings else self.text.lm_head(h)


MODEL_TYPES = {"gemma3_text": Gemma3TextAdapter, "gemma3": Gemma3TextAdapter}
