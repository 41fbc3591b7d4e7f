"""``python -m bench overhead``: what the router adds per request and per relayed event, beside vllm-router."""
