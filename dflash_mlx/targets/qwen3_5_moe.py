"""Qwen3.5 / Qwen3.6 MoE targets (``qwen3_5_moe``): the qwen3_5 walk, MoE blocks run as loaded."""

from .qwen3_5 import Qwen35Adapter


class Qwen35MoeAdapter(Qwen35Adapter):
    """mlx_lm.models.qwen3_5_moe."""


MODEL_TYPES = {"qwen3_5_moe": Qwen35MoeAdapter}
