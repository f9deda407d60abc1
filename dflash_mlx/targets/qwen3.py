"""Qwen3 targets: the generic decoder (one causal mask, tied or untied head)."""

from .base import TargetAdapter


class Qwen3Adapter(TargetAdapter):
    """mlx_lm.models.qwen3: nothing differs from the generic forward."""

    supports_tree = True


MODEL_TYPES = {"qwen3": Qwen3Adapter, "qwen3_vl": Qwen3Adapter}
