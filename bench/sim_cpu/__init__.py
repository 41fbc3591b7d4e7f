"""``python -m bench sim_cpu``: the simulator's own CPU while streaming to many clients."""
