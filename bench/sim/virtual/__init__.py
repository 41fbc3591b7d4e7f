"""The fleet in virtual time: the real router core in front of modelled engines under a MockClock.

``tailguard advise`` replays a trace through it once per candidate split of
the GPUs; ``python -m bench sweep`` runs its load x set-up grid on it. No
sockets, no HTTP, no CPU per token: an hour of traffic costs seconds.

- ``clock``: the timeline of timed callbacks that moves the MockClock;
- ``engine``: ``tailguard.sim.Engine``'s schedule, stepped in aggregate;
- ``fleet``: set-ups (pools, classes, caps), the fleet and its open loop;
- ``mix``: the traffic mix (request shapes, bodies, capacity) and percentiles;
- ``trace``: arrival schedules, and traces of them on disk.
"""
