"""The drafter a training run starts from: fresh (shaped like the target's layers), warm-started from another
drafter's weights (``--init``, grown by layers), or made a DSpark one (``--arch dspark``, spec section 11)."""

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx

from ..drafter.checkpoint import load_drafter
from ..drafter.config import DrafterArgs, default_target_layer_ids
from ..drafter.formats import DSPARK
from ..drafter.network import DFlashDrafter
from ..drafter.vocab import head_columns, set_draft_vocab
from ..errors import InputError
from ..pair.loading import bind_drafter
from ..targets import TargetAdapter


def init_drafter(target: TargetAdapter, mask_token_id: int, layers: int = 1, block_size: int = 16,
                 target_layer_ids: Optional[List[int]] = None, intermediate_size: Optional[int] = None,
                 seed: int = 0, markov_rank: Optional[int] = None, confidence: bool = False) -> DFlashDrafter:
    """A fresh bound v1 drafter for verifies of ``block_size`` shaped like the target's layers (layer ids spread
    evenly by default), or with ``markov_rank`` a DSpark one (:func:`as_dspark`); InputError for a layer id
    outside the target or a mask id outside the vocabulary."""
    a = target.args
    n_heads = a.num_attention_heads
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, layers)
    if min(ids) < 0 or max(ids) >= target.num_layers:
        raise InputError(f"--target-layer-ids {ids}: the target has layers 0..{target.num_layers - 1}")
    if not 0 <= mask_token_id < target.vocab_size:
        raise InputError(f"--mask-token-id {mask_token_id} is outside the vocabulary [0, {target.vocab_size})")
    args = DrafterArgs(hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=n_heads,
                       num_key_value_heads=getattr(a, "num_key_value_heads", None) or n_heads,
                       head_dim=getattr(a, "head_dim", None) or target.hidden_size // n_heads,
                       intermediate_size=intermediate_size or a.intermediate_size, vocab_size=target.vocab_size,
                       target_layer_ids=list(ids), mask_token_id=mask_token_id, block_size=block_size,
                       num_target_layers=target.num_layers, rms_norm_eps=getattr(a, "rms_norm_eps", 1e-6),
                       rope_theta=float(getattr(a, "rope_theta", 10000.0)),
                       max_position_embeddings=getattr(a, "max_position_embeddings", None) or 40960)
    mx.random.seed(seed)
    drafter = DFlashDrafter(args)
    drafter = drafter if markov_rank is None else as_dspark(drafter, target, markov_rank, confidence)
    mx.eval(drafter.parameters())
    return bind_drafter(drafter, target)


def as_dspark(drafter: DFlashDrafter, target: TargetAdapter, markov_rank: int,
              confidence: bool = False) -> DFlashDrafter:
    """An unbound v1 ``drafter`` as a DSpark one (``Qwen3DSparkModel``, spec section 11) for the same verifies:
    its weights, a block one row shorter whose every row drafts, copies of the target's embedding and head, a
    Markov head of ``markov_rank`` (0: none, DeepSeek's DFlash block7 layout) whose bias starts at zero, and
    with ``confidence`` a confidence head (reading the Markov embedding where there is one)."""
    a = drafter.args
    new = DFlashDrafter(replace(a, architecture=DSPARK.architecture, markov_rank=markov_rank, config=None,
                                block_size=a.block_size - 1, enable_confidence_head=confidence,
                                confidence_head_with_markov=confidence and markov_rank > 0))
    new.update(drafter.parameters())
    head = head_columns(target.head, a.hidden_size, drafter.fc.weight.dtype)  # [H, V], 256 rows at a time
    new.update({"embed_tokens": {"weight": target.embed(mx.arange(a.vocab_size)[None])[0]},
                "lm_head": {"weight": mx.contiguous(head.T)}})
    if markov_rank:
        new.markov_head["markov_w2"].weight = mx.zeros_like(new.markov_head["markov_w2"].weight)
    return new


def warm_start(path: str, target: TargetAdapter, layers: Optional[int] = None,
               markov_rank: Optional[int] = None, confidence: bool = False) -> DFlashDrafter:
    """The drafter at ``path`` (any folder ``--draft-model`` loads; quantized layers dequantized to float) bound to
    ``target``, to train on from its weights (``--init``). With ``layers`` above its own count, full-attention layers
    are added after its own with zero ``o_proj`` and ``down_proj``: the grown drafter drafts exactly as the loaded one
    until trained. With ``markov_rank`` a v1 drafter becomes a DSpark one (:func:`as_dspark`). InputError for fewer
    ``layers``; else raises as :func:`load_drafter` and :func:`bind_drafter`."""
    from mlx_lm.utils import dequantize_model

    drafter = dequantize_model(load_drafter(path))
    set_draft_vocab(drafter, None)  # trained over the whole vocabulary (--draft-vocab sets one at the end)
    if layers is not None and layers < (had := drafter.args.num_hidden_layers):
        raise InputError(f"--layers {layers}: the --init drafter {path} has {had}; give as many or more")
    if layers and layers > had:
        a = drafter.args
        types = a.layer_types and a.layer_types + ["full_attention"] * (layers - had)
        grown = type(drafter)(replace(a, num_hidden_layers=layers, layer_types=types))
        for layer in grown.layers[had:]:
            layer.update({"self_attn": {"o_proj": {"weight": mx.zeros_like(layer.self_attn.o_proj.weight)}},
                          "mlp": {"down_proj": {"weight": mx.zeros_like(layer.mlp.down_proj.weight)}}})
        drafter = grown.update(drafter.parameters())
    if markov_rank is not None and not drafter.args.format.anchor_first:
        drafter = as_dspark(drafter, target, markov_rank, confidence)
    return bind_drafter(drafter, target, path)
