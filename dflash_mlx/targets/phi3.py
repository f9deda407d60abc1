"""Phi-3 targets (mlx_lm.models.phi3: one causal mask, fused ``qkv_proj`` and ``gate_up_proj``, the layers' own
RoPE): the generic decoder as it is; no tree verify, which runs the attention's projections one by one."""

from .base import TargetAdapter

MODEL_TYPES = {"phi3": TargetAdapter}
