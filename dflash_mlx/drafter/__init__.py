"""The drafter: network.py (the method), batch.py (a batch in one pass), config.py, formats.py and
variants.py (its config.json), checkpoint.py (its files). Import from the submodules."""
