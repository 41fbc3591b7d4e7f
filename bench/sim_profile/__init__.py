"""``python -m bench sim_profile``: the simulated engine's TTFT and ITL by concurrency, in virtual time."""
