"""The benchmarks: ``python -m bench`` lists the drivers; ``bench.harness`` is the one library they share.

``duplicates --repo bench`` lists pairs of places to look at. Two are
deliberate and explained where they stand: the simulated engine's counters in
``tailguard.sim.Engine`` and ``tailguard.server.advise.replay.engine.SweepEngine``, and
the held-streams records ``hold.records.HoldRun`` and
``grpc_overhead.records.OpenStreams``. The others it lists are alike in shape
only: keyword constructors filled from options or tallies (``x=options.x``,
one line a field of a result record), a frozen dataclass of float defaults, and
``__main__.DRIVERS``, a table. Each names different fields of a different
record; folding them into one helper would trade a readable field list for
indirection, and the committed JSON fixes the field names.
"""
