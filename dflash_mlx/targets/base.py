"""The generic decoder adapter: runs an mlx-lm model's own modules in its ``__call__`` order,
capturing context features (spec section 3); family files override only what differs."""

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.models.gemma4_text import logit_softcap

from ..prompt_cache.batch import share_offsets
from ..prompt_cache.gated_delta import GatedDeltaCache
from ..prompt_cache.rollback import EXACT_TRIM, Count, rollback
from ..prompt_cache.window import WindowKVCache
from ..errors import MismatchError, RollbackError
from .fused import attention_mask
from .tree_verify import TreeVerify


class TargetAdapter(TreeVerify):
    """Feature-capturing forward for one mlx-lm family.

    Args:
        model: an mlx-lm ``Model``; its text model is ``model.language_model`` when there is one.

    Attributes:
        model: the model as loaded.
        text: the text model (``args``, ``model``, and ``lm_head`` when untied).
        inner: ``text.model``, the decoder stack (``embed_tokens``, ``layers``, ``norm``).
        args: ``text.args``.
        rollback_spans_forwards: a rollback may remove rows of several forwards (False where a
            layer can only undo its last forward: the next plain step then waits for this one)."""

    rollback_spans_forwards = True
    logit_cap: Optional[float] = None  # final_logit_softcapping: lm_head is cap * tanh(head / cap)

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = getattr(model, "language_model", model)
        self.inner = self.text.model
        self.args = self.text.args
        self.stages = getattr(self.inner, "pipeline_size", 1)  # ranks the layers are split over (pipeline)
        if self.stages > 1:
            self.supports_tree = False  # tree verify walks every layer in one process

    @property
    def layers(self) -> List[nn.Module]:
        """This process's layers: all of them, or its stage's under pipeline sharding."""
        return getattr(self.inner, "pipeline_layers", self.inner.layers)

    @property
    def num_layers(self) -> int:
        """Layers of the whole target (on every stage under pipeline sharding)."""
        return self.args.num_hidden_layers if self.stages > 1 else len(self.layers)

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

    def head(self, h: mx.array) -> mx.array:
        """[..., H] normed hidden -> [..., V] logits before any softcap (linear); tied or untied, quantized or not."""
        return self.text.lm_head(h) if hasattr(self.text, "lm_head") else self.inner.embed_tokens.as_linear(h)

    def lm_head(self, h: mx.array) -> mx.array:
        """[1, L, H] normed hidden -> [1, L, V] logits: :meth:`head`, capped where :attr:`logit_cap` is set."""
        return self.head(h) if self.logit_cap is None else logit_softcap(self.logit_cap, self.head(h))

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        """One attention mask per layer (all causal here)."""
        mask = attention_mask(h, cache[0])
        return [mask] * self.num_layers

    def run_layers(self, inputs: mx.array, h: mx.array, cache: Sequence[Any]) -> Iterator[mx.array]:
        """Yield [1, L, H], the residual stream after each layer, from ``h`` = :meth:`embed` of
        ``inputs`` [1, L] and one cache entry per layer."""
        for layer, c, mask in zip(self.layers, cache, self.masks(h, cache)):
            h = layer(h, mask, c)
            yield h

    def __call__(self, inputs: mx.array, cache: Sequence[Any], capture: Optional[Sequence[int]] = None,
                 tree: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """Forward pass with feature capture.

        Args:
            inputs: [1, L] int32 token ids.
            cache: the model's prompt cache (updated in place).
            capture: layer ids whose output is captured, Hugging Face's ``hidden_states[l+1]``
                (spec section 3); the last layer's is after the final norm.
            tree: for a tree verify (spec section 7), ``(positions [L] int, ancestors [L, L]
                bool)``; only for families with :attr:`supports_tree`.

        Returns:
            ``(hidden, features)``: hidden [1, L, H] after the final norm (feed it to
            :meth:`lm_head`), features [1, L, len(capture)*H] or None.

        Raises:
            MismatchError: a capture id is not a layer of the target.
            InputError: a tree for a family without tree verification."""
        wanted = set(capture or ())
        if wanted and not all(0 <= i < self.num_layers for i in wanted):
            raise MismatchError(f"target_layer_ids {sorted(wanted)} name layers beyond the target's "
                                f"{self.num_layers} (0..{self.num_layers - 1})")
        if self.stages > 1:
            return self._pipeline_call(inputs, cache, capture)
        captured = {}
        share_offsets(cache)  # a batch's layers share one offset array: the fused RoPE computes its rows once
        h = self.embed(inputs)
        layers = self.run_layers(inputs, h, cache) if tree is None else self.run_tree_layers(h, cache, *tree)
        for i, h in enumerate(layers):
            if i in wanted:
                captured[i] = h
        h = self.inner.norm(h)
        captured[self.num_layers - 1] = h
        features = mx.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        return h, features

    def _pipeline_call(self, inputs: mx.array, cache: Sequence[Any], capture: Optional[Sequence[int]]):
        """:meth:`__call__` on one pipeline stage (mlx-lm's split: the last rank holds the first
        layers, rank 0 the last). The stage takes the residual stream from the rank above, runs its
        layers and hands it to the rank below; rank 0's final stream is gathered by all, and each
        captured layer's output is summed from the stage that holds it, so every rank returns the same."""
        rank, first = self.inner.pipeline_rank, self.inner.start_idx
        mx.eval(inputs)  # the drafts' own all-sums first: a receive waits on no input, so it could run before them
        h = self.embed(inputs)
        if rank < self.stages - 1:
            h = mx.distributed.recv_like(h, rank + 1)
        captured = {}
        for i, h in enumerate(self.run_layers(inputs, h, cache), start=first):
            captured[i] = h
        if rank != 0:
            h = mx.distributed.send(h, rank - 1)
        h = self.inner.norm(mx.distributed.all_gather(h)[: h.shape[0]])
        if not capture:
            return h, None
        last, parts = self.num_layers - 1, []
        for i in capture:  # the last layer's output is the normed stream, which rank 0 adds
            x = (h if rank == 0 else None) if i == last else captured.get(i)
            parts.append(mx.zeros_like(h) if x is None else x)
        features = mx.depends(mx.concatenate(parts, axis=-1), h)  # every rank: the gather, then the sum
        return h, mx.distributed.all_sum(features)

    def make_cache(self, max_verify: int = 1) -> List[Any]:
        """mlx-lm's prompt cache, each layer made exact by :meth:`exact_cache`.

        Args:
            max_verify: most tokens one verify feeds: the most rows one rollback removes.

        Raises:
            RollbackError: a layer cache that cannot be made exact (names it)."""
        cache = [self.exact_cache(i, c, max_verify) for i, c in enumerate(make_prompt_cache(self.model))]
        self.check_cache(cache, max_verify)
        return cache

    def exact_cache(self, i: int, c: Any, max_verify: int) -> Any:
        """Layer ``i``'s mlx-lm cache, or a ``WindowKVCache`` for a ``RotatingKVCache``.

        Raises:
            RollbackError: a ``RotatingKVCache`` with sink rows (``keep > 0``)."""
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise RollbackError(f"target layer {i}: RotatingKVCache keeps {c.keep} sink rows; "
                                    "speculative decoding cannot roll it back exactly")
            return WindowKVCache(c.max_size, slack=max_verify)
        return c

    def check_cache(self, cache: Sequence[Any], max_verify: int) -> None:
        """Refuse a cache that cannot roll back ``max_verify`` rows exactly or that another model built.

        Raises:
            MismatchError: another number of layers, or a layer cache of another model.
            RollbackError: names the first layer that cannot roll back exactly, and its cache type."""
        expected = len(make_prompt_cache(self.model))
        if len(cache) != expected:
            raise MismatchError(f"the prompt cache has {len(cache)} layer caches but this target needs {expected}: "
                                f"it was built for another model; use {type(self).__name__}.make_cache()")
        for i, c in enumerate(cache):
            self.check_layer_cache(i, c, max_verify)

    def check_layer_cache(self, i: int, c: Any, max_verify: int) -> None:
        """:meth:`check_cache` for layer ``i``; raises as it does."""
        if isinstance(c, GatedDeltaCache):
            raise MismatchError(f"target layer {i} is an attention layer but its cache is a Gated-DeltaNet "
                                f"cache: it was built for another model; use {type(self).__name__}.make_cache()")
        if isinstance(c, WindowKVCache):
            if c.slack < max_verify:
                raise RollbackError(f"target layer {i}: sliding-window cache (window {c.window}) keeps "
                                    f"{c.slack} rows for rollback but a verify feeds {max_verify}; "
                                    f"build it with make_cache(max_verify={max_verify})")
        elif not isinstance(c, EXACT_TRIM):
            what = type(c).__name__
            if isinstance(c, RotatingKVCache):
                what += f" (sliding window {c.max_size})"
            raise RollbackError(f"target layer {i}: {what} cannot be rolled back exactly, so speculative "
                                f"decoding would not reproduce the target; use {type(self).__name__}.make_cache()")

    def rollback(self, cache: Sequence[Any], rejected: Count) -> None:
        """Remove the last ``rejected`` rows from every layer (an int or [1]: one sequence; [N]: sequence i of a
        batch its last ``rejected[i]``), or none (:func:`~dflash_mlx.prompt_cache.rollback.rollback`).

        Raises:
            RollbackError: a layer cannot remove that many rows exactly."""
        rollback(cache, [rejected] * len(cache), "target layer")
