"""Custom kernels, each with a plain-MLX reference that defines its result and is its fallback."""
