"""The drafter: the network (network.py: the DFlash method), its config (config.py: the fields every
format shares) and the checkpoint formats (formats.py: each format's own keys and wiring), the keys
other tools write for the same drafter (variants.py), and checkpoints on disk (checkpoint.py). Adding a drafter format is a change to formats.py and its test.
"""
