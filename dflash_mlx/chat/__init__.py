"""Multi-turn chat: the session (session.py: turns, context limits, streamed pieces) over a prompt cache
that keeps the pair's caches between turns (prompt_cache.py)."""
