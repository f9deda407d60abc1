"""Gemma 4 targets: scaled embeddings, per-layer inputs, KV-shared last layers (no cache),
masks by ``layer_types``, logit softcapping."""

from typing import Any, Iterator, Sequence

import mlx.core as mx

from .base import TargetAdapter


class Gemma4TextAdapter(TargetAdapter):
    """mlx_lm.models.gemma4_text."""

    def embed(self, inputs: mx.array) -> mx.array:
        """Embeddings times the model's ``embed_scale``."""
        return self.inner.embed_tokens(inputs) * self.inner.embed_scale

    def run_layers(self, inputs: mx.array, h: mx.array, cache: Sequence[Any]) -> Iterator[mx.array]:
        inner, n = self.inner, self.num_layers
        per_layer = [None] * n
        if inner.hidden_size_per_layer_input:
            slices = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(inputs))
            per_layer = [slices[:, :, i, :] for i in range(n)]
        cache = list(cache) + [None] * (n - len(cache))  # KV-shared layers have none
        masks = inner._make_masks(h, cache)
        shared = [(None, None)] * n  # (keys and values, offset) each layer produced
        for i, (layer, c, mask, source) in enumerate(zip(self.layers, cache, masks, inner.previous_kvs)):
            kvs, offset = shared[source]
            h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
            shared[i] = (kvs, offset)
            yield h

    @property
    def logit_cap(self):
        return self.text.final_logit_softcapping

    def head(self, h: mx.array) -> mx.array:
        return self.inner.embed_tokens.as_linear(h) if self.text.tie_word_embeddings else self.text.lm_head(h)


MODEL_TYPES = {"gemma4_text": Gemma4TextAdapter, "gemma4": Gemma4TextAdapter}
