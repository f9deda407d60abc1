"""Custom Metal kernels, each with a plain-MLX reference that defines its result and is the fallback.

Import from the kernel's module, e.g.
``from dflash_mlx.kernels.block_attention import block_attention, attention_path``
(the package does not re-export them, so the module name stays the module).
"""
