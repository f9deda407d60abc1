"""Custom Metal kernels, each with a plain-MLX reference that defines its result and is the fallback."""

from .block_attention import attention_path, block_attention, block_attention_reference

__all__ = ["attention_path", "block_attention", "block_attention_reference"]
