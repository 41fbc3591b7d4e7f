"""The capacity planner behind ``tailguard advise``: how many GPUs go to which pool, and whether to lend, predicted in virtual time.

It replays a recorded trace (``bench tail --record-trace``) or tailguard's own
JSON access log against the virtual-time fleet model that ``bench sweep`` also runs
(``replay``: the real router core, ``Router.open`` with its
caps, queues and lending, in front of modelled engines under a MockClock),
once per candidate assignment of the fleet's engines:

- every static split of the N engines between the interactive pool and the
  batch pool (1..N-1 interactive engines), as ``bench tail``'s
  ``disaggregated`` set-up runs them: interactive engines with that pool's
  profile and per-endpoint cap, batch engines with the batch pool's;
- each split again with the interactive pool lending idle seats to batch
  requests (``[pools.interactive.lend]``) under a few rules, once also with
  the batch pool lending its idle seats back to interactive requests, and
  under the config file's own rules;
- and two baselines: round robin over N batch-profile engines with no router
  (``shared``), and the same without the long requests (the short-only ideal).

For each it predicts short E2E P99, short TTFT P99 (failed short requests
count as infinitely slow) and long goodput: long requests finished ok per
second, from the trace's start to the last one's end, also as a fraction of
``shared``'s. The recommendation is the best long goodput among candidates
whose short E2E P99 is within 1.25x the ideal's and short TTFT P99 within
2x; if none is, the candidate that misses those bounds by the least.

The whole trace or access log is replayed (``--seconds`` bounds it; at most
a day of arrivals and 50,000 requests, and a longer one is cut and says so),
with a first line saying how much of it was used: lines read and used, the
seconds of arrivals, and lines skipped for each reason (not JSON, not an
access line, a rejected request, no size, an unparseable time, after the
window), so an operator can tell advice on their traffic from advice on a
tenth of it. Under 50 requests to replay there is no recommendation (``cli``
says why).

The engines cache prefixes: requests the log (``prefix_group``,
``cached_tokens``) says shared a prefix replay with a shared text, placed as
one key (``prefixes``), and each candidate's predicted prefix hit rate is
reported; ``--no-prefix-cache`` replays every prompt unique.

Everything is in GPU seconds (the trace's own). Simulated time costs
nothing; a candidate costs ~0.1-0.2 ms of CPU a request.

Its modules, one job each, in the order a run uses them:

- ``cli``: the command line ``tailguard advise`` dispatches to;
- ``fleet``: the fleet a config file describes (engines, the two pools);
- ``traffic`` and ``access_log``: the arrivals, from a trace or an access log;
- ``prefixes``: replayed prompts that share what the log says was shared;
- ``candidates``: the assignments tried, as configs and replay set-ups;
- ``simulate``: each set-up replayed, its requests' fates, the numbers;
- ``verdict``: every candidate beside the baselines, one recommended;
- ``report``: the table, the snippet, the JSON;
- ``thresholds``, ``judge`` and ``joint``: the class-threshold search over an access log;
- ``replay``: the real router in virtual time over modelled engines.

The real-time check of a prediction (the ``bench tail`` run of the
recommended candidate, measured beside predicted) is a benchmark, in a
checkout only: ``python -m bench.tail.advise_check``.
"""
