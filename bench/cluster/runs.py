"""The cluster benchmark's runs under load: plain load, kill -9 of one replica, Redis stopped or paused."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from bench.cluster.lab import ANSWERED, HEALTH_POLL_S, LEDGER_POLL_S, PHASE_DRAIN, Engine, Lab
from bench.cluster.ledger import LedgerView
from bench.cluster.load import Played, capacity, class_summary, key_of_each, key_results, play_against
from bench.cluster.watch import CapWatch, scrape, watch_engine, watch_summary
from bench.harness.client import HOST, ProtocolError
from bench.harness.open_loop import Sample, TokenClient, TokenPool
from bench.harness.replicas import Replica, health_of
from tailguard.server.advise.replay.trace import Arrival, generated

# -- phase 2: load ---------------------------------------------------------------------------


async def load_run(lab: Lab, setup: str, replicas: Sequence[Replica], traffic: str, load: float) -> dict[str, Any]:
    o = lab.options
    rate = load * capacity(o)
    seed = o.seed + int(load * 100) + (1000 if traffic == "bursty" else 0)
    arrivals = generated(rate, o.warmup, o.window, seed, o.burst_period if traffic == "bursty" else None)
    keys = key_of_each(arrivals, seed)
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    origin = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in watches:
            nursery.start_soon(watch_engine, w, o.sample_interval, origin)
        played = await play_against([r.port for r in replicas], arrivals, keys, o.drain, f"{setup} {traffic} {load:g}")
        nursery.cancel_scope.cancel()
    for r in replicas:
        if not r.alive:
            raise RuntimeError(f"{r.name} exited with {r.process.returncode} during the run; see {r.log}")
    return {
        "setup": setup,
        "traffic": traffic,
        "load": load,
        "rate_per_s": round(rate, 3),
        "arrivals": len(arrivals),
        "wall_s": round(played.wall, 1),
        "machine_cores": round(played.cores, 2),
        "load_average": played.load_average,
        "short": class_summary(played, "short", o.window),
        "long": class_summary(played, "long", o.window),
        "keys": key_results(played),
        "engines": watch_summary(watches),
    }


# -- phase 3: kill -9 one replica ----------------------------------------------------------------


async def kill_run(lab: Lab, replicas: list[Replica], victim: Replica, view: LedgerView) -> dict[str, Any]:
    """Poisson at the first load; ``victim`` killed with SIGKILL a third into the window, taken out of the client's round robin."""
    o = lab.options
    rate = o.loads[0] * capacity(o)
    arrivals = generated(rate, o.warmup, o.window, o.seed + 7, None)
    keys = key_of_each(arrivals, o.seed + 7)
    kill_at = o.warmup + o.window / 3
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    found: dict[str, Any] = {"victim": victim.name, "kill_at_s": kill_at, "lease_ttl": o.lease_ttl}
    origin = time.perf_counter()

    async def killer(targets: list[TokenPool]) -> None:
        await trio.sleep_until(trio.current_time() + kill_at - (time.perf_counter() - origin))
        held = {r: g.get(victim.name, 0) for r, g in (await view.grants()).items()}
        found["victim_grants_at_kill"] = {r: n for r, n in held.items() if n}
        victim.process.kill()  # SIGKILL
        killed = time.perf_counter()
        targets[:] = [t for t in targets if t.port != victim.port]  # the client's balancer drops it at once
        lapsed = cleared = None
        deadline = killed + 4 * o.lease_ttl
        while time.perf_counter() < deadline and (lapsed is None or cleared is None):
            if lapsed is None and not await view.alive(victim.name):
                lapsed = time.perf_counter() - killed
            grants = await view.grants()
            if cleared is None and not any(victim.name in g for g in grants.values()):
                cleared = time.perf_counter() - killed
            await trio.sleep(LEDGER_POLL_S)
        found["lease_gone_after_s"] = None if lapsed is None else round(lapsed, 3)
        found["grants_gone_after_s"] = None if cleared is None else round(cleared, 3)
        found["grants_after"] = await view.grants()

    async with trio.open_nursery() as nursery:
        for w in watches:
            nursery.start_soon(watch_engine, w, o.sample_interval, origin)
        played = await play_against([r.port for r in replicas], arrivals, keys, max(o.drain, PHASE_DRAIN), f"kill -9 {victim.name}", killer)
        nursery.cancel_scope.cancel()
    survivors = {r.port for r in replicas if r is not victim}
    on_survivors = [s for s, port in zip(played.samples, played.sent_to) if port in survivors]
    on_victim = [s for s, port in zip(played.samples, played.sent_to) if port == victim.port]
    found |= {
        "arrivals": len(arrivals),
        "survivor_outcomes": _outcomes(on_survivors),
        "survivor_unanswered": sum(1 for s in on_survivors if s.outcome not in ANSWERED),
        "victim_outcomes": _outcomes(on_victim),
        "survivor_short": class_summary(played, "short", o.window, lambda port: port in survivors),
        "keys": key_results(played),
        "engines": watch_summary(watches),
        "load_average": played.load_average,
        "machine_cores": round(played.cores, 2),
    }
    return found


def _outcomes(samples: Sequence[Sample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    return counts


# -- phase 4: Redis gone --------------------------------------------------------------------------


async def outage_run(
    lab: Lab, replicas: list[Replica], view: LedgerView, mode: str, hold: float, dead: Sequence[str], victim: Replica | None, skew: bool = False
) -> dict[str, Any]:
    """Load at the highest load; Redis killed (``mode`` "stop", started again empty) or paused ("pause") for ``hold`` s.

    ``victim`` is killed with SIGKILL halfway through the outage. ``dead`` are
    the replicas killed before, whose names must not come back in the ledger.
    With ``skew``, the client sends everything to the first replica until
    Redis goes (a balancer out of step), round robin from then on: the first
    replica holds most seats when the ledger fails.
    """
    o = lab.options
    pre, post = 5.0, 10.0
    rate = max(o.loads) * capacity(o)
    arrivals = generated(rate, 0.0, pre + hold + post, o.seed + (11 if mode == "stop" else 13), None)
    keys = key_of_each(arrivals, o.seed + 11)
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    caps = lab.caps()
    health: dict[str, list[tuple[float, str, str]]] = {r.name: [] for r in replicas}
    ledger_max: dict[str, int] = {}
    ledger_reads = {"ok": 0, "failed": 0}
    found: dict[str, Any] = {
        "mode": mode, "hold_s": hold, "pre_s": pre, "post_s": post, "load": max(o.loads), "victim": victim.name if victim else None, "skew": skew,
        "replicas": [r.name for r in replicas],
    }
    origin = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - origin

    outage = partial(_outage, lab, replicas, _Outage(mode, pre, hold, victim, skew), found, now)
    try:
        async with trio.open_nursery() as nursery:
            for w in watches:
                nursery.start_soon(watch_engine, w, o.sample_interval, origin)
            for r in replicas:
                nursery.start_soon(_watch_health, r, health[r.name], now)
            nursery.start_soon(_watch_ledger, lab, view, ledger_max, ledger_reads)
            played = await play_against([r.port for r in replicas], arrivals, keys, max(o.drain, PHASE_DRAIN), f"redis {mode} {hold:g} s", outage)
            await trio.sleep(2 * o.lease_ttl + 1.0)  # idle: every replica back on the ledger, past the recovery window
            nursery.cancel_scope.cancel()
    finally:
        if lab.redis.paused:
            lab.redis.pause(False)
        if lab.redis.process is None:
            await lab.redis.start()
    down, back = found["redis_down_at_s"], found["redis_back_at_s"]
    live = [r for r in replicas if r.alive]
    served = _ok_during(replicas, played, arrivals, down + 1.0, back)
    grants = await view.grants()
    in_flight = {r.name: sum((await scrape(r.port)).get("tailguard_pool_in_flight", {}).values()) for r in live}
    everyone = {r.name for r in live}
    found |= {
        "arrivals": len(arrivals),
        "outcomes": _outcomes(played.samples),
        "unanswered_on_survivors": sum(
            1 for s, port in zip(played.samples, played.sent_to) if s.outcome not in ANSWERED and (victim is None or port != victim.port)
        ),
        "ok_during_outage": served,
        "health": health,
        "fallback_within_s": _first_mode(health, "fallback", down, victim),
        "ledger_again_within_s": _first_mode(health, "ledger", back, victim),
        "degraded_everywhere": all(any(st == "degraded" for _, st, _ in health[r.name]) for r in replicas if r is not victim),
        "ledger_reads": ledger_reads,
        "ledger_max_sum": ledger_max,
        "ledger_over_cap": {r: n for r, n in ledger_max.items() if n > caps[r]},
        "grants_after": grants,
        "grant_sum_after": {r: sum(g.values()) for r, g in grants.items()},
        "strangers_after": sorted({name for g in grants.values() for name in g} - everyone),
        "idle_grant_above_block": {r: {n: s for n, s in g.items() if s > o.block} for r, g in grants.items() if any(s > o.block for s in g.values())},
        "dead_in_ledger": await _dead_in_ledger(view, grants, dead),
        "in_flight_after": in_flight,
        "engines": watch_summary(watches),
        "keys": {} if skew else key_results(played),  # skewed: the keys have no max_concurrency
        "load_average": played.load_average,
        "machine_cores": round(played.cores, 2),
    }
    return found


@dataclass(frozen=True)
class _Outage:
    """What one outage does to Redis and when: ``pre`` s of load first, then ``hold`` s without the ledger."""

    mode: str  # "stop" or "pause"
    pre: float
    hold: float
    victim: Replica | None  # killed halfway through
    skew: bool  # everything to the first replica until Redis goes


async def _outage(lab: Lab, replicas: list[Replica], plan: _Outage, found: dict[str, Any], now: Callable[[], float], targets: list[TokenPool]) -> None:
    """The outage itself, beside the load: Redis down, the victim killed, Redis back; when each happened lands in ``found``."""
    mode, pre, hold, victim = plan.mode, plan.pre, plan.hold, plan.victim
    everyone = list(targets)
    if plan.skew:
        targets[:] = [t for t in targets if t.port == replicas[0].port]
    await trio.sleep_until(trio.current_time() + pre - now())
    found["held_at_outage"] = {r.name: await _in_flight_by_endpoint(r, lab.engines) for r in replicas}
    targets[:] = everyone
    found["redis_down_at_s"] = round(now(), 2)
    if mode == "stop":
        await lab.redis.kill()
    else:
        lab.redis.pause(True)
    await trio.sleep_until(trio.current_time() + pre + hold / 2 - now())
    if victim is not None:
        victim.process.kill()
        targets[:] = [t for t in targets if t.port != victim.port]
        found["victim_killed_at_s"] = round(now(), 2)
    await trio.sleep_until(trio.current_time() + pre + hold - 1.0 - now())
    found["grants_in_fallback"] = {r.name: await _cluster_grants(r) for r in replicas if r.alive}
    await trio.sleep_until(trio.current_time() + pre + hold - now())
    if mode == "stop":
        await lab.redis.start()
    else:
        lab.redis.pause(False)
    found["redis_back_at_s"] = round(now(), 2)


async def _watch_health(replica: Replica, trail: list[tuple[float, str, str]], now: Callable[[], float]) -> None:
    """The replica's /health while it lives: each change of (status, cluster mode) appended to ``trail``."""
    client = TokenClient(replica.port)
    try:
        while replica.alive:
            status, cluster_mode = await health_of(client, replica.port)
            if not trail or trail[-1][1:] != (status, cluster_mode):
                trail.append((round(now(), 2), status, cluster_mode))
            await trio.sleep(HEALTH_POLL_S)
    finally:
        await client.aclose()


async def _watch_ledger(lab: Lab, view: LedgerView, ledger_max: dict[str, int], ledger_reads: dict[str, int]) -> None:
    """The ledger read every 0.1 s while Redis runs: the largest sum of grants per resource, reads that worked and failed."""
    while True:
        if not lab.redis.paused and lab.redis.process is not None:
            try:
                with trio.fail_after(1.0):
                    grants = await view.grants()
            except Exception:  # Redis down or restarting: counted, not fatal
                ledger_reads["failed"] += 1
            else:
                ledger_reads["ok"] += 1
                for resource, held in grants.items():
                    ledger_max[resource] = max(ledger_max.get(resource, 0), sum(held.values()))
        await trio.sleep(0.1)


def _ok_during(replicas: list[Replica], played: Played, arrivals: Sequence[Arrival], start: float, end: float) -> dict[str, int]:
    """ok answers per replica to the requests sent from ``start`` until ``end``."""
    served = {r.name: 0 for r in replicas}
    for s, port, a in zip(played.samples, played.sent_to, arrivals):
        if s.outcome == "ok" and start <= a.at < end:
            served[next(r.name for r in replicas if r.port == port)] += 1
    return served


async def _dead_in_ledger(view: LedgerView, grants: dict[str, dict[str, int]], dead: Sequence[str]) -> list[str]:
    """What the ledger still holds of the ``dead`` replicas: their leases, grants and wants."""
    return (
        [k for k in await view.keys() if any(k.endswith(f":alive:{d}") for d in dead)]
        + [f"{r}:{d}" for r, g in grants.items() for d in dead if d in g]
        + [f"{k}:{d}" for k, w in (await view.wants()).items() for d in dead if d in w]
    )


async def _in_flight_by_endpoint(replica: Replica, engines: Sequence[Engine]) -> dict[str, float]:
    """The replica's requests running on each capped engine (its tailguard_endpoint_in_flight), by engine role."""
    try:
        with trio.fail_after(2.0):
            metrics = await scrape(replica.port)
    except (OSError, trio.BrokenResourceError, ProtocolError, trio.TooSlowError):
        return {}
    urls = {f"http://{HOST}:{e.port}": e.role for e in engines}
    return {urls[url]: value for labels, value in metrics.get("tailguard_endpoint_in_flight", {}).items() if (url := dict(labels).get("endpoint")) in urls}


async def _cluster_grants(replica: Replica) -> dict[str, float]:
    try:
        with trio.fail_after(2.0):
            metrics = await scrape(replica.port)
    except (OSError, trio.BrokenResourceError, ProtocolError, trio.TooSlowError):
        return {}
    return {dict(labels)["resource"]: value for labels, value in metrics.get("tailguard_cluster_grant_seats", {}).items()}


def _first_mode(health: dict[str, list[tuple[float, str, str]]], mode: str, since: float, killed: Replica | None) -> float | None:
    """Seconds after ``since`` by which every replica but ``killed`` had reported ``mode`` (None if one never did)."""
    worst = 0.0
    for name, trail in health.items():
        if killed is not None and name == killed.name:
            continue
        seen = [t for t, _, m in trail if m == mode and t >= since]
        if not seen:
            return None
        worst = max(worst, seen[0] - since)
    return round(worst, 2)
