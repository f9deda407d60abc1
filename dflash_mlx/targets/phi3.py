"""Phi-3 targets (mlx_lm.models.phi3): the generic decoder; no tree verify (its attention fuses ``qkv_proj``)."""

from .base import TargetAdapter


class Phi3Adapter(TargetAdapter):
    """mlx_lm.models.phi3: one causal mask, the layers' own RoPE (plain, linear or su-scaled)."""


MODEL_TYPES = {"phi3": Phi3Adapter}
