"""``python -m bench estimate``: the prompt estimate beside a real tokenizer, and what /tokenize per request would cost."""
