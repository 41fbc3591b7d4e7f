"""``python -m bench quick_mixed``: the first tail run: one shared engine vs tailguard, the origin's mix."""
