"""Run an mlx-lm model while capturing context features, without changing it.

The adapter walks the loaded model's own modules (embedding, decoder layers, final
norm, head) in the same order as the family's ``__call__``; it never patches or
wraps them, so the model is left exactly as loaded. Each family file overrides
only what differs from this generic decoder (masks, embedding scale, ...).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import MismatchError


class TargetAdapter:
    """Feature-capturing forward for one mlx-lm family.

    Args:
        model: an mlx-lm ``Model`` (``model.model`` holds ``embed_tokens``,
            ``layers`` and ``norm``).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = model.model

    @property
    def layers(self) -> List[nn.Module]:
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def dtype(self) -> mx.Dtype:
        return self.inner.norm.weight.dtype

    def embed(self, inputs: mx.array) -> mx.array:
        """[1, L] int -> [1, L, H] input embeddings (the drafter uses this too)."""
        return self.inner.embed_tokens(inputs)

    def lm_head(self, h: mx.array) -> mx.array:
        """[1, L, H] normed hidden -> [1, L, V] logits; tied or untied, quantized or not."""
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(h)
        return self.inner.embed_tokens.as_linear(h)

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        """One attention mask per layer (all causal here)."""
        mask = create_attention_mask(h, cache[0])
        return [mask] * self.num_layers

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[Any],
        capture: Optional[Sequence[int]] = None,
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """Forward pass with feature capture.

        Args:
            inputs: [1, L] int32 token ids.
            cache: the model's prompt cache (updated in place).
            capture: target layer ids whose OUTPUT (residual stream after the layer,
                Hugging Face ``hidden_states[l+1]``, spec section 3) is captured.

        Returns:
            ``(hidden, features)``: hidden [1, L, H] after the final norm (feed it to
            :meth:`lm_head`), features [1, L, len(capture)*H] or None.
        """
        h = self.embed(inputs)
        wanted = set(capture or ())
        captured = {}
        for i, (layer, c, mask) in enumerate(zip(self.layers, cache, self.masks(h, cache))):
            h = layer(h, mask, c)
            if i in wanted:
                captured[i] = h
        features = mx.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        return self.inner.norm(h), features

    def make_cache(self) -> List[Any]:
        """A fresh prompt cache, as mlx-lm makes it."""
        return make_prompt_cache(self.model)

    def can_rollback(self, cache: Sequence[Any]) -> bool:
        return can_trim_prompt_cache(list(cache))

    def check_rollback(self, cache: Sequence[Any]) -> None:
        """Raise if this cache cannot be rolled back after a verify.

        Raises:
            MismatchError: the cache holds non-trimmable (recurrent) layers.
        """
        if not self.can_rollback(cache):
            raise MismatchError(
                f"{type(self.model).__module__}: this target's cache cannot be rolled back "
                "(recurrent or rotating layers); speculative decoding is not supported for it yet"
            )

    def rollback(self, cache: Sequence[Any], num_tokens: int) -> None:
        """Drop the last ``num_tokens`` rows of every layer's cache (rejected drafts)."""
        if num_tokens > 0:
            trim_prompt_cache(list(cache), num_tokens)
