"""The prompt cache: layer caches that roll back exactly (target, drafter, batch), and the store that
keeps a pair's caches after a prompt's first tokens, in memory and on disk."""
