"""Run an mlx-lm model while capturing context features, without changing it.

The adapter walks the loaded model's own modules (embedding, decoder layers, final
norm, head) in the same order as the family's ``__call__``; it never wraps them
(on MLX's CPU backend :func:`~dflash_mlx.targets.make_adapter` only swaps the class
of its RMSNorm and RoPE modules for fused ones that compute the same bits,
:mod:`dflash_mlx.targets.fused`). Each family file overrides
only what differs from this generic decoder (masks, embedding scale, the layer
walk, the head), and where a layer's mlx-lm cache cannot roll back, the cache
class that replaces it (:mod:`dflash_mlx.prompt_cache.trim`). What only some families
use lives beside them: tree verify in :mod:`dflash_mlx.targets.tree_verify` (the
:class:`~dflash_mlx.targets.tree_verify.TreeVerify` mixin), the Gated-DeltaNet
layers and their cache checks in :mod:`dflash_mlx.targets.hybrid`.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..prompt_cache.gated_delta import GatedDeltaCache
from ..prompt_cache.trim import EXACT_TRIM, can_trim
from ..prompt_cache.window import WindowKVCache
from ..errors import MismatchError, RollbackError
from .fused import attention_mask
from .tree_verify import TreeVerify


class TargetAdapter(TreeVerify):
    """Feature-capturing forward for one mlx-lm family.

    Args:
        model: an mlx-lm ``Model``. Its text model is ``model.language_model`` when
            there is one (vision-language wrappers such as ``qwen3_vl``, and every
            ``qwen3_5`` model), else ``model`` itself; the text model's ``model``
            holds ``embed_tokens``, ``layers`` and ``norm``.

    Attributes:
        model: the model as loaded (weights and memory are counted on it).
        text: the text model (has ``args``, ``model`` and, when untied, ``lm_head``).
        inner: ``text.model``, the decoder stack.
        args: ``text.args``, the text model's ``ModelArgs``.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = getattr(model, "language_model", model)
        self.inner = self.text.model
        self.args = self.text.args

    @property
    def layers(self) -> List[nn.Module]:
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def dtype(self) -> mx.Dtype:
        return self.inner.norm.weight.dtype

    def embed(self, inputs: mx.array) -> mx.array:
        """[1, L] int -> [1, L, H] input embeddings (the drafter uses this too)."""
        return self.inner.embed_tokens(inputs)

    def lm_head(self, h: mx.array) -> mx.array:
        """[1, L, H] normed hidden -> [1, L, V] logits; tied or untied, quantized or not."""
        if hasattr(self.text, "lm_head"):
            return self.text.lm_head(h)
        return self.inner.embed_tokens.as_linear(h)

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        """One attention mask per layer (all causal here)."""
        mask = attention_mask(h, cache[0])
        return [mask] * self.num_layers

    def run_layers(self, inputs: mx.array, h: mx.array, cache: Sequence[Any]) -> Iterator[mx.array]:
        """Run the decoder layers on the embedded inputs, as the family's ``__call__``.

        Args:
            inputs: [1, L] token ids (for families that embed more than once).
            h: [1, L, H] output of :meth:`embed`.
            cache: one entry per layer.

        Yields:
            [1, L, H] the residual stream after each layer, in order.
        """
        for layer, c, mask in zip(self.layers, cache, self.masks(h, cache)):
            h = layer(h, mask, c)
            yield h

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[Any],
        capture: Optional[Sequence[int]] = None,
        tree: Optional[Tuple[np.ndarray, np.ndarray]] = None,
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
            tree: for a tree verify (DDTree, spec section 7), ``(positions [L] int
                absolute position of each input, ancestors [L, L] bool)``: each input
                sees every cached row and, among the inputs, only its ancestors and
                itself. Only for families with :attr:`supports_tree`.

        Returns:
            ``(hidden, features)``: hidden [1, L, H] after the final norm (feed it to
            :meth:`lm_head`), features [1, L, len(capture)*H] or None.

        Raises:
            MismatchError: a capture id is not a layer of the target.
            InputError: a tree for a family without tree verification.
        """
        wanted = set(capture or ())
        if wanted and not all(0 <= i < self.num_layers for i in wanted):
            raise MismatchError(
                f"target_layer_ids {sorted(wanted)} name layers beyond the target's "
                f"{self.num_layers} (0..{self.num_layers - 1})"
            )
        captured = {}
        h = self.embed(inputs)
        layers = self.run_layers(inputs, h, cache) if tree is None else self.run_tree_layers(h, cache, *tree)
        for i, h in enumerate(layers):
            if i in wanted:
                captured[i] = h
        h = self.inner.norm(h)
        captured[self.num_layers - 1] = h
        features = mx.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        return h, features

    def make_cache(self, max_verify: int = 1) -> List[Any]:
        """A fresh prompt cache, as mlx-lm makes it, that rolls back exactly.

        Layers whose mlx-lm cache cannot roll back get one of ours (see
        :meth:`exact_cache`): a :class:`~dflash_mlx.prompt_cache.window.WindowKVCache` instead of a
        ``RotatingKVCache`` (which cannot be trimmed once it wraps), and in hybrid
        targets (:mod:`dflash_mlx.targets.hybrid`) a
        :class:`~dflash_mlx.prompt_cache.gated_delta.GatedDeltaCache` instead of a Gated-DeltaNet
        layer's ``ArraysCache``.

        Args:
            max_verify: most tokens one verify forward feeds (the block size, or a
                tree's node count + 1): the most rows one rollback removes.

        Raises:
            RollbackError: a layer cache that cannot be made exact (names it).
        """
        cache = [self.exact_cache(i, c, max_verify) for i, c in enumerate(make_prompt_cache(self.model))]
        self.check_cache(cache, max_verify)
        return cache

    def exact_cache(self, i: int, c: Any, max_verify: int) -> Any:
        """Layer ``i``'s cache as mlx-lm made it, or ours where it cannot roll back.

        Raises:
            RollbackError: a ``RotatingKVCache`` with sink rows (``keep > 0``).
        """
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise RollbackError(
                    f"target layer {i}: RotatingKVCache keeps {c.keep} sink rows; "
                    "speculative decoding cannot roll it back exactly"
                )
            return WindowKVCache(c.max_size, slack=max_verify)
        return c

    def check_cache(self, cache: Sequence[Any], max_verify: int) -> None:
        """Refuse, before generation starts, a cache that cannot roll back exactly or
        that another model built.

        Raises:
            MismatchError: the cache has another number of layers, or a recurrent
                layer's cache belongs to another model (one line, names the layer).
            RollbackError: one line naming the first layer whose cache cannot roll
                back exactly, and its cache type.
        """
        expected = len(make_prompt_cache(self.model))
        if len(cache) != expected:
            raise MismatchError(
                f"the prompt cache has {len(cache)} layer caches but this target needs {expected}: "
                f"it was built for another model; use {type(self).__name__}.make_cache()"
            )
        for i, c in enumerate(cache):
            self.check_layer_cache(i, c, max_verify)

    def check_layer_cache(self, i: int, c: Any, max_verify: int) -> None:
        """Refuse layer ``i``'s cache when it cannot roll back ``max_verify`` rows exactly
        or another model built it (:class:`~dflash_mlx.targets.hybrid.HybridAdapter`
        adds its Gated-DeltaNet layers' checks).

        Raises:
            MismatchError, RollbackError: as :meth:`check_cache`.
        """
        if isinstance(c, GatedDeltaCache):
            raise MismatchError(
                f"target layer {i} is an attention layer but its cache is a Gated-DeltaNet "
                f"cache: it was built for another model; use {type(self).__name__}.make_cache()"
            )
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
