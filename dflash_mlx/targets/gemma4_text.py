"""Gemma 4 targets (``gemma4_text``; the ``gemma4`` vision wrapper holds one).

Differs from the generic decoder in:
- the embedding scale (sqrt(hidden));
- per-layer inputs (small models): a second embedding of the ids plus a projection
  of the scaled embedding, one slice per layer, built by the model's own methods;
- KV sharing: the last ``num_kv_shared_layers`` layers have no cache and reuse the
  keys, values and positions of the last earlier layer of their kind;
- sliding-window and full layers by ``layer_types``, masks from the first layer
  of each kind;
- logit softcapping after the head (``final_logit_softcapping``).
Per-layer scalars, MoE blocks and ``attention_k_eq_v`` live inside the layers,
which run as loaded.
"""

from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx_lm.models.gemma4_text import logit_softcap

from .base import TargetAdapter


class Gemma4TextAdapter(TargetAdapter):
    """mlx_lm.models.gemma4_text."""

    def embed(self, inputs: mx.array) -> mx.array:
        """Scaled embeddings, as the model's first step (and Hugging Face's scaled
        word embedding, which drafters are trained on)."""
        return self.inner.embed_tokens(inputs) * self.inner.embed_scale

    def run_layers(self, inputs: mx.array, h: mx.array, cache: Sequence[Any]) -> Iterator[mx.array]:
        inner, n = self.inner, self.num_layers
        per_layer = [None] * n
        if inner.hidden_size_per_layer_input:
            # The model's own (private) helpers, so the per-layer inputs are its own.
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

    def lm_head(self, h: mx.array) -> mx.array:
        text = self.text
        out = self.inner.embed_tokens.as_linear(h) if text.tie_word_embeddings else text.lm_head(h)
        if text.final_logit_softcapping is not None:
            out = logit_softcap(text.final_logit_softcapping, out)
        return out


# model_type -> adapter: targets/__init__.py collects these from every file in targets/
MODEL_TYPES = {"gemma4_text": Gemma4TextAdapter, "gemma4": Gemma4TextAdapter}
