"""``python -m bench pairs``: router_overhead against two commits' router, in alternating pairs."""
