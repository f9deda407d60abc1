"""The drafter: the network (network.py: the DFlash method), its config (config.py: the fields every
format shares) and the checkpoint formats (formats.py: each format's own keys and wiring), the keys
other tools write for the same drafter (variants.py), and checkpoints on disk (checkpoint.py). Adding a drafter format is a change to formats.py and its test.
"""

from .._moved import DRAFTER_MODULE, forward

_SUBMODULES = ("network", "config", "formats", "checkpoint")


def __getattr__(name: str):  # ``from dflash_mlx.drafter import DFlashDrafter`` (the old module), deprecated
    return forward(__name__, DRAFTER_MODULE, name, _SUBMODULES)
