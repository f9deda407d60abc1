"""The OpenAI-compatible server: the app (app.py), the API schema (api.py), the engine (engine.py), metrics."""
