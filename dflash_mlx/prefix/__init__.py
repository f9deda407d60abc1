"""The prefix cache: a pair's caches kept after a prompt's first tokens, in memory and on
disk, so a later prompt sharing those tokens prefills only the rest (issue 22).

- ``key.py``: the pair's identity an entry must match.
- ``layers.py``: one layer cache of each kind to and from arrays and integers.
- ``entry.py``: an entry (both caches after some tokens), written and checked on disk.
- ``store.py``: memory and disk levels, longest-prefix lookup, least-recently-used eviction.
- ``resume.py``: states kept at prompt boundaries for pairs that cannot trim back.
- ``batch.py``: lookup, restore and store for the requests of a batch (``serve --max-batch N``).

:class:`dflash_mlx.chat.prompt_cache.PairCache` uses them (chat, serve, generate), and
:class:`dflash_mlx.decode.batch_join.Joining` (continuous batching) through ``batch.py``.
"""
