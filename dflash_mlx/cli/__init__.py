"""The ``dflash`` command line (installed as ``dflash_mlx.cli``)."""
