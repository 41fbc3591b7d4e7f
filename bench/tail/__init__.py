"""``python -m bench tail``: short-request P99 under mixed load, set-ups side by side."""
