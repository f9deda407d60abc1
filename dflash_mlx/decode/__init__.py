"""Decoding: the loop (generate.py: draft -> verify -> accept -> roll back -> next context), the verify
modes (verify.py), the acceptance rules (acceptance.py), draft trees (tree.py), stop strings (stopping.py)
and each step's width, fixed or chosen by measured rate (width.py)."""
