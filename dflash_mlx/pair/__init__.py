"""A target + drafter pair on disk and in memory: loading (loading.py), the pair manifest (manifest.py),
converting a checkpoint into a checked pair folder (convert.py) and its validation runs (validation.py)."""
