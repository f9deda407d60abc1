"""The prompt cache: every layer cache that rolls back exactly (target, drafter and batch caches),
and the store that keeps a pair's caches after a prompt's first tokens, in memory and on disk,
so a later prompt sharing those tokens prefills only the rest.

- ``trim.py``: the trim contract; ``window.py``, ``gated_delta.py``, ``drafter_context.py``: caches
  that roll back where mlx-lm's cannot; ``batch*.py``: a batch's caches and per-sequence rollback.
- ``key.py``, ``layers.py``, ``entry.py``, ``store.py``, ``resume.py``: entries kept and looked up.
- ``pair.py``: the target's and drafter's caches of one conversation; ``batch_prefix.py``: the
  same for the requests of a batch.
"""
