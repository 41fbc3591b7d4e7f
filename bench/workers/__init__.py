"""``python -m bench workers``: serve --workers 2 beside --workers 1 and vllm-router: req/s, CPU per request."""
