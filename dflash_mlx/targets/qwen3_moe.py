"""Qwen3 MoE targets (``qwen3_moe``: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B)."""

from .base import TargetAdapter


class Qwen3MoeAdapter(TargetAdapter):
    """mlx_lm.models.qwen3_moe: one causal mask; the sparse MoE blocks run as loaded."""

    supports_tree = True


MODEL_TYPES = {"qwen3_moe": Qwen3MoeAdapter, "qwen3_vl_moe": Qwen3MoeAdapter}
