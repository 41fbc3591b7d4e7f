"""The cluster benchmark's load: the modelled capacity, one schedule played against a group, and its numbers per key and class."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from bench.cluster.lab import KEYS, Options
from bench.harness.clocks import MachineClock
from bench.harness.open_loop import Sample, TokenPool, class_stats, play, token_times
from bench.harness.replicas import KeySpec
from bench.harness.unique import ShapeRequests, run_seed
from tailguard.server.advise.replay.mix import origin_mix, pooled_capacity, shapes_by_class
from tailguard.server.advise.replay.trace import Arrival
from tailguard.sim.params import PROFILES


def capacity(options: Options) -> float:
    """Requests/s (real) at which the capped engines are full for the origin's mix (the lesser pool's figure)."""
    mix = shapes_by_class(origin_mix())
    latency = PROFILES["latency"].replace(max_num_seqs=options.seats)
    throughput = PROFILES["throughput"].replace(max_num_seqs=options.seats)
    gpu = min(pooled_capacity(1, latency, mix["short"]), pooled_capacity(2, throughput, mix["long"]))
    return gpu / options.time_scale


def key_of_each(arrivals: Sequence[Arrival], seed: int) -> list[KeySpec]:
    rng = random.Random(seed)
    return rng.choices(KEYS, weights=[k.share for k in KEYS], k=len(arrivals))


@dataclass
class Played:
    samples: list[Sample]
    sent_to: list[int]  # the replica port each arrival went to
    keys: list[KeySpec]
    wall: float
    cores: float  # the machine's busy cores over the run
    load_average: list[float]


async def play_against(
    ports: list[int], arrivals: list[Arrival], keys: list[KeySpec], drain: float, label: str, during: Callable[[list[TokenPool]], Any] | None = None
) -> Played:
    """Play the schedule round robin over ``ports``; ``during(targets)`` runs alongside and may remove a target."""
    pools = [TokenPool(p) for p in ports]
    targets = list(pools)  # one list: one round robin over both classes; ``during`` may shrink it (a killed replica)
    sent_to: dict[int, int] = {}
    key_at = {id(a): k for a, k in zip(arrivals, keys)}
    unique = ShapeRequests(run_seed(label))  # every prompt its own; the engines outlive one run, so a seed per run

    def request_of(port: int, number: int, arrival: Arrival) -> bytes:
        key = key_at[id(arrival)]
        sent_to[id(arrival)] = port
        return unique(port, number, arrival).replace(b"\r\n", f"\r\nAuthorization: Bearer {key.secret}\r\n".encode(), 1)

    load_average = [round(x, 2) for x in os.getloadavg()]
    before = MachineClock.read()
    try:
        async with trio.open_nursery() as nursery:
            if during is not None:
                nursery.start_soon(during, targets)
            samples, wall = await play({"short": targets, "long": targets}, request_of, arrivals, drain, label)
            nursery.cancel_scope.cancel()
    finally:
        for pool in pools:
            await pool.aclose()
    cores = MachineClock.read().cores_since(before)
    return Played(samples, [sent_to.get(id(a), 0) for a in arrivals[: len(samples)]], keys, wall, cores, load_average)


def overlap(intervals: Sequence[tuple[float, float]], cap: int) -> tuple[int, float, float]:
    """(most at once, seconds above ``cap`` in all, longest stretch above ``cap`` in s) of [start, end) intervals."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # an end sorts before a start at the same time
    now = most = 0
    above = longest = 0.0
    since: float | None = None
    for at, step in events:
        now += step
        most = max(most, now)
        if now > cap and since is None:
            since = at
        elif now <= cap and since is not None:
            above += at - since
            longest = max(longest, at - since)
            since = None
    return most, above, longest


def key_results(played: Played) -> dict[str, dict[str, Any]]:
    """Per key: outcomes, and how many of its requests the client saw at once (two ways), against its cap."""
    found: dict[str, dict[str, Any]] = {}
    for key in KEYS:
        mine = [s for s, k in zip(played.samples, played.keys) if k is key]
        outcomes: dict[str, int] = {}
        for s in mine:
            outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
        answered = [(s.sent, s.sent + s.e2e) for s in mine if s.status == 200 and s.e2e is not None]
        streaming = [(t[0], t[-1]) for s in mine if s.outcome == "ok" and (t := token_times(s))]
        most_sent, _, _ = overlap(answered, key.max_concurrency)
        most, above, longest = overlap(streaming, key.max_concurrency)
        found[key.name] = {
            "cap": key.max_concurrency,
            "sent": len(mine),
            "outcomes": outcomes,
            "max_streaming": most,  # first to last token of each 200: inside the router's hold, but for the client's own lag
            "streaming_above_cap_ms": round(above * 1000, 2),
            "longest_above_cap_ms": round(longest * 1000, 2),
            "max_sent_to_end": most_sent,  # send to last byte of each 200: an upper bound (network and client lag on both ends)
        }
    return found


def class_summary(played: Played, kind: str, window: float, only: Callable[[int], bool] | None = None) -> dict[str, Any]:
    samples = [s for s, port in zip(played.samples, played.sent_to) if only is None or only(port)]
    stats = class_stats(kind, samples, 1.0, window, None)
    return {"n": stats.n, "outcomes": stats.outcomes, "e2e_ms": stats.e2e_ms, "ttft_ms": stats.ttft_ms}
