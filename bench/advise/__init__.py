"""``tailguard advise``: the capacity planner (installed as ``tailguard.advise``; it runs the simulator, never serves)."""
