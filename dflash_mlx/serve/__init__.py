"""The OpenAI-compatible server: the ASGI app (app.py), the request/response schema (api.py), the engine
that runs one generation at a time over the loaded pair (engine.py) and its metrics (metrics.py)."""
