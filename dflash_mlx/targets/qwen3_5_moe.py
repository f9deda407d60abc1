"""Qwen3.5 / Qwen3.6 MoE targets (``qwen3_5_moe``, e.g. 35B-A3B).

The layers are ``qwen3_5``'s with a sparse MoE block as the MLP; the block runs
as the model's own module, so nothing differs from :class:`Qwen35Adapter`.
"""

from .qwen3_5 import Qwen35Adapter


class Qwen35MoeAdapter(Qwen35Adapter):
    """mlx_lm.models.qwen3_5_moe: the qwen3_5 walk; MoE blocks run as loaded."""


# model_type -> adapter: targets/__init__.py collects these from every file in targets/
MODEL_TYPES = {"qwen3_5_moe": Qwen35MoeAdapter}
