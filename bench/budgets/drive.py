"""Driving a run: the open loop spread unevenly over the replicas, the kill -9 and the Redis outage on cue, /health watched.

Real time, 127.0.0.1 only. Arrivals are Poisson (seeded), each drawn a
replica by the spread's weights; a request due at a replica killed by then
goes to a live one, drawn by the same weights among the living (its
clients move, as a balancer's would). Every request is a non-streaming
chat with a unique prompt and ``ignore_eos``, so its usage is its prompt
and ``max_tokens``. Everything stops at the last arrival plus ``drain``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import trio

from bench.budgets.model import CALL_TIMEOUT_S, HEALTH_POLL_S, KEY_SECRET, Options, Sent, Trail
from bench.budgets.setup import Fleet
from bench.harness.client import CHAT_PATH, HOST
from bench.harness.open_loop import TokenClient, error_code
from bench.harness.replicas import Replica, health_of
from bench.harness.traffic import START_DELAY_S, poisson_offsets
from bench.harness.unique import run_seed
from tailguard.server.advise.replay.mix import prompt_tokens, unique_body_for
from tailguard.sim.server import DEFAULT_MODEL


@dataclass
class Driven:
    """What a run saw: every request, each replica's /health trail, when the timeline's events happened (s from the origin)."""

    sent: list[Sent]
    health: dict[str, Trail]
    events: dict[str, float] = field(default_factory=dict)


def body(o: Options, number: int) -> dict[str, object]:
    """Request ``number``'s body: unique prompt of ``prompt_tokens``, ``max_tokens``, ``ignore_eos``, not streamed."""
    return unique_body_for(o.prompt_tokens, o.max_tokens, number, seed=run_seed(o.seed, "budgets")) | {"stream": False, "model": DEFAULT_MODEL}


def reserve_of(o: Options) -> int:
    """What admission reserves for each request (the simulator's prompt count and max_tokens): every request's the same."""
    return prompt_tokens(body(o, 0)) + o.max_tokens


def arrival_rate(o: Options) -> float:
    """Requests a second that offer ``load`` times the budget's tokens a second."""
    return o.load * o.budget / 60.0 / reserve_of(o)


async def drive(o: Options, fleet: Fleet) -> Driven:
    offsets = poisson_offsets(arrival_rate(o), o.duration, run_seed(o.seed, "budgets", "arrivals"))
    picks = random.Random(run_seed(o.seed, "budgets", "spread")).choices(range(o.replicas), weights=o.spread, k=len(offsets))
    moved = random.Random(run_seed(o.seed, "budgets", "moved"))
    reserve = reserve_of(o)
    dead: set[int] = set()
    driven = Driven([], {r.name: [] for r in fleet.replicas})
    origin = trio.current_time() + START_DELAY_S

    def now() -> float:
        return trio.current_time() - origin

    clients = [_client(r) for r in fleet.replicas]
    try:
        with trio.move_on_at(origin + o.duration + o.drain):
            async with trio.open_nursery() as watchers:
                for i, r in enumerate(fleet.replicas):
                    watchers.start_soon(_watch_health, r, driven.health[r.name], now, lambda i=i: i in dead)
                watchers.start_soon(_timeline, o, fleet, dead, driven.events, origin)
                async with trio.open_nursery() as senders:
                    for number, (at, pick) in enumerate(zip(offsets, picks)):
                        await trio.sleep_until(origin + at)
                        index = pick if pick not in dead else _among_living(o, dead, moved)
                        sent = Sent(number, fleet.replicas[index].name, at, reserve)
                        driven.sent.append(sent)
                        senders.start_soon(_send, clients[index], body(o, number), sent, now)
                watchers.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.aclose()
    return driven


def _client(replica: Replica) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://{HOST}:{replica.port}",
        headers={"Authorization": f"Bearer {KEY_SECRET}"},
        timeout=CALL_TIMEOUT_S,
        limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
    )


def _among_living(o: Options, dead: set[int], rng: random.Random) -> int:
    living = [i for i in range(o.replicas) if i not in dead]
    return rng.choices(living, weights=[o.spread[i] for i in living])[0]


async def _send(client: httpx.AsyncClient, payload: dict[str, object], sent: Sent, now: Callable[[], float]) -> None:
    """One request; ``sent`` gets its answer: a 200's usage, an error's code and Retry-After, or the transport's failure."""
    sent.sent = now()
    try:
        response = await client.post(CHAT_PATH, json=payload)
    except httpx.HTTPError as error:
        sent.code = type(error).__name__
        return
    finally:
        sent.ended = now()
    sent.status = response.status_code
    if response.status_code == 200:
        usage = response.json().get("usage") or {}
        sent.tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        return
    sent.code = error_code(response.content)
    try:
        sent.retry_after = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        sent.retry_after = None


async def _timeline(o: Options, fleet: Fleet, dead: set[int], events: dict[str, float], origin: float) -> None:
    """At ``kill_at`` the victim killed with SIGKILL; at ``outage_at`` redis-server SIGSTOPped for ``outage_s``, then SIGCONT."""
    steps: list[tuple[float, str]] = []
    if o.kill_at is not None:
        steps.append((o.kill_at, "kill"))
    if o.outage_at is not None:
        steps += [(o.outage_at, "stop"), (o.outage_at + o.outage_s, "resume")]
    for at, step in sorted(steps):
        await trio.sleep_until(origin + at)
        if step == "kill":
            victim = fleet.replicas[o.victim]
            dead.add(o.victim)
            victim.process.kill()
            events["killed_at"] = trio.current_time() - origin
        else:
            fleet.redis.pause(step == "stop")
            events["redis_stopped_at" if step == "stop" else "redis_resumed_at"] = trio.current_time() - origin


async def _watch_health(replica: Replica, trail: Trail, now: Callable[[], float], killed: Callable[[], bool]) -> None:
    """The replica's /health every HEALTH_POLL_S until it is killed (or the run is cut): each change of (status, mode) noted."""
    client = TokenClient(replica.port)
    try:
        while not killed():
            status, mode = await health_of(client, replica.port)
            if not killed() and (not trail or trail[-1][1:] != (status, mode)):
                trail.append((round(now(), 2), status, mode))
            await trio.sleep(HEALTH_POLL_S)
    finally:
        await client.aclose()
