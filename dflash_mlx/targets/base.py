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
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..caches import EXACT_TRIM, WindowKVCache, can_trim
from ..errors import RollbackError


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
            capture: target layer ids whose OUTPUT is captured: Hugging Face's
                ``hidden_states[l+1]`` (spec section 3), i.e. the residual stream
                after layer l, and for the last layer the output after the final
                norm, as Hugging Face models return it. Training and inference both
                capture here, so they always agree.

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
        h = self.inner.norm(h)
        captured[self.num_layers - 1] = h
        features = mx.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        return h, features

    def make_cache(self, max_verify: int = 1) -> List[Any]:
        """A fresh prompt cache, as mlx-lm makes it, that rolls back exactly.

        Sliding-window layers get a :class:`~dflash_mlx.caches.WindowKVCache` instead
        of mlx-lm's ``RotatingKVCache``, which cannot be trimmed once it wraps.

        Args:
            max_verify: most tokens one verify forward feeds (the block size, or a
                tree's node count + 1): the most rows one rollback removes.

        Raises:
            RollbackError: a layer cache that cannot be made exact (names it).
        """
        cache = make_prompt_cache(self.model)
        for i, c in enumerate(cache):
            if isinstance(c, RotatingKVCache):
                if c.keep:
                    raise RollbackError(
                        f"target layer {i}: RotatingKVCache keeps {c.keep} sink rows; "
                        "speculative decoding cannot roll it back exactly"
                    )
                cache[i] = WindowKVCache(c.max_size, slack=max_verify)
        self.check_cache(cache, max_verify)
        return cache

    def check_cache(self, cache: Sequence[Any], max_verify: int) -> None:
        """Refuse, before generation starts, a cache that cannot roll back exactly.

        Raises:
            RollbackError: one line naming the first such layer and its cache type.
        """
        for i, c in enumerate(cache):
            if isinstance(c, WindowKVCache):
                if c.slack < max_verify:
                    raise RollbackError(
                        f"target layer {i}: sliding-window cache (window {c.window}) keeps "
                        f"{c.slack} rows for rollback but a verify feeds {max_verify}; "
                        f"build it with make_cache(max_verify={max_verify})"
                    )
            elif not isinstance(c, EXACT_TRIM):
                what = type(c).__name__
                if isinstance(c, RotatingKVCache):
                    what += f" (sliding window {c.max_size})"
                raise RollbackError(
                    f"target layer {i}: {what} cannot be rolled back exactly, so speculative "
                    f"decoding would not reproduce the target; use {type(self).__name__}.make_cache()"
                )

    def rollback(self, cache: Sequence[Any], num_tokens: int) -> None:
        """Remove the last ``num_tokens`` rows (rejected drafts) from every layer.

        Every layer is checked first and every trimmed count is verified, so the
        cache is either rolled back exactly or left as it was and an error raised.

        Raises:
            RollbackError: a layer cannot remove that many rows exactly.
        """
        if num_tokens <= 0:
            return
        for i, c in enumerate(cache):
            if not can_trim(c, num_tokens):
                raise RollbackError(
                    f"target layer {i}: {type(c).__name__} cannot remove its last {num_tokens} "
                    "rows exactly (rows it needs were dropped or it is not trimmable)"
                )
        for i, c in enumerate(cache):
            trimmed = c.trim(num_tokens)
            if trimmed != num_tokens:
                raise RollbackError(
                    f"target layer {i}: {type(c).__name__} trimmed {trimmed} of {num_tokens} rows"
                )

