"""``python -m bench cardinality``: API keys rotated by reloads: /metrics size and lines, RSS after an idle minute."""
