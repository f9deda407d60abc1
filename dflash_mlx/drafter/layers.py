"""mlx-lm's layer pieces a drafter layer is made of, under the checkpoint's names: ``qwen3``'s (spec section 4), or for
Gemma 4 DSpark (spec section 11; DeepSpec ``deepspec/modeling/dspark/gemma4/modeling.py``) ``gemma4_text``'s:

- ``self_attn``: ``q_proj``, ``k_proj``, ``o_proj`` with ``global_head_dim`` heads, ``v_proj`` unless
  ``attention_k_eq_v`` (V is then K's projection; ``num_global_key_value_heads`` heads); ``q_norm``, ``k_norm``,
  a weightless ``v_norm``; scale 1; ``rope_parameters.full_attention`` (proportional: part of the head rotates).
- A layer: ``h += post_attention_layernorm(attn(input_layernorm(h)))``, ``h += post_feedforward_layernorm(mlp(
  pre_feedforward_layernorm(h)))`` (GeGLU, gelu-tanh), then ``h *= layer_scalar`` [1].
- Embeddings times sqrt(hidden_size); logits capped by ``final_logit_softcapping``, as the target's.
"""

from typing import Any

import mlx.nn as nn
from mlx_lm.models import gemma4_text, qwen3

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "v_norm", "rope", "n_heads", "n_kv_heads",
             "scale")
LAYER = ("mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm", "layer_scalar")


def mlx_lm_layer(args: Any) -> nn.Module:
    """mlx-lm's layer of DrafterArgs ``args``: qwen3's, or Gemma 4's (full attention with its own K/V)."""
    shape = dict(hidden_size=args.hidden_size, num_hidden_layers=1, intermediate_size=args.intermediate_size,
                 num_attention_heads=args.num_attention_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
                 num_key_value_heads=args.num_key_value_heads, rms_norm_eps=args.rms_norm_eps,
                 max_position_embeddings=args.max_position_embeddings)
    if not args.format.gemma4:
        return qwen3.TransformerBlock(qwen3.ModelArgs("qwen3", rope_theta=args.rope_theta, tie_word_embeddings=False,
                                                      rope_scaling=args.rope_scaling, **shape))
    return gemma4_text.DecoderLayer(gemma4_text.ModelArgs(
        global_head_dim=args.global_head_dim, num_global_key_value_heads=args.num_global_key_value_heads,
        attention_k_eq_v=args.attention_k_eq_v, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
        layer_types=["full_attention"], **shape,
        rope_parameters={"full_attention": dict(args.rope_scaling or {}, rope_theta=args.rope_theta)}), 0)


def adopt(ours: nn.Module, theirs: nn.Module, names) -> None:
    """Set on ``ours`` each of ``names`` that ``theirs`` has (modules, parameters and plain attributes)."""
    for name in filter(lambda n: hasattr(theirs, n), names):
        setattr(ours, name, getattr(theirs, name))

