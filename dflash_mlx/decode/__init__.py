"""Decoding: the loop (generate.py: draft -> verify -> accept -> roll back -> next context), the verify
modes (verify.py), the acceptance rules (acceptance.py), draft trees (tree.py), stop strings (stopping.py)
and the adaptive policy (policy.py) with its cost model (cost.py) and timings (calibration.py)."""
