"""Real vLLM engines: the tiny model built (model.py) and vLLM's own server started on it (engines.py)."""
