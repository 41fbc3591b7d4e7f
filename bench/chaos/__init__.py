"""``python -m bench chaos``: killed, hung and broken engines, hostile clients, reloads: what must hold."""
