"""``python -m bench router_overhead``: closed-loop HTTP latency and CPU per request, direct vs through tailguard."""
