"""The real router replayed over modelled engines in virtual time: what ``tailguard advise`` judges configs with.

``tailguard advise`` replays a trace through it once per candidate split of
the GPUs; ``python -m bench sweep`` and ``bench trace`` run their grids on it.
No sockets, no HTTP, no CPU per token: an hour of traffic costs seconds. The
engines are modelled after ``tailguard.sim``'s (the simulated vLLM).

- ``clock``: the timeline of timed callbacks that moves the MockClock;
- ``engine``: ``tailguard.sim.Engine``'s schedule, stepped in aggregate;
- ``setups``: set-ups (pools, classes, caps, with or without a router);
- ``fleet``: a set-up's engines and router in one Trio run, and one request through them;
- ``point``: a set-up under a schedule of arrivals, its records and numbers;
- ``rebalancing``: the router's rebalancing loop, run on the replay's clock;
- ``mix``: the traffic mix (request shapes, bodies, capacity) and percentiles;
- ``trace``: arrival schedules, and traces of them on disk.
"""
