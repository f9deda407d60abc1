"""Training a DFlash drafter for any mlx-lm target (DFLASH_SPEC.md section 6)."""
