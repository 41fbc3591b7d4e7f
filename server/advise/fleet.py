"""The fleet a config file describes: N engines and the two pools advise splits them between.

The first class's pool is the interactive one, the catch-all's the batch
one; each pool's engines run its ``simulate_profile`` with its per-endpoint
cap and queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tailguard.router.config import Config, PoolConfig
from tailguard.sim import PROFILES
from tailguard.sim.params import EngineParams

MAX_ENGINES = 16


@dataclass(frozen=True)
class PoolPlan:
    """One pool of the file, per engine: what an engine put in it runs and may take."""

    config: PoolConfig
    profile: str  # tailguard.sim profile of its engines (the pool's simulate_profile)
    seats: int  # max_concurrency of each endpoint
    queue: int  # max_queue per endpoint

    @property
    def params(self) -> EngineParams:
        return PROFILES[self.profile]


@dataclass(frozen=True)
class Fleet:
    """N engines and the two pools they may be split between, from a config file."""

    engines: int
    interactive: PoolPlan  # the first class's pool (short requests)
    batch: PoolPlan  # the catch-all class's pool
    base: Config
    urls: tuple[str, ...]  # the file's endpoint URLs, interactive's first (for the snippet)

    @property
    def short_class(self) -> str:
        return self.base.classes[0].name


def _plan(pool: PoolConfig) -> PoolPlan:
    endpoints = len(pool.endpoints)
    seats = pool.endpoints[0].max_concurrency if endpoints else PROFILES[pool.simulate_profile].max_num_seqs
    queue = math.ceil(pool.max_queue / endpoints) if endpoints else pool.max_queue
    return PoolPlan(pool, pool.simulate_profile, seats, queue)


def fleet_from(config: Config, engines: int | None) -> Fleet:
    """The fleet a config describes: its first class's pool and its catch-all's, and their engines.

    Raises ValueError when the config has no such two pools, or classes routed elsewhere.
    """
    first, last = config.classes[0], config.classes[-1]
    if first.pool == last.pool:
        raise ValueError(
            f"classes {first.name!r} and {last.name!r} share pool {first.pool!r}: advise splits engines between two pools"
        )
    stray = [k.name for k in config.classes if k.pool not in (first.pool, last.pool)]
    if stray:
        raise ValueError(f"classes {', '.join(stray)} use a third pool; advise splits engines between {first.pool!r} and {last.pool!r}")
    interactive, batch = config.pool(first.pool), config.pool(last.pool)
    urls = tuple(e.url for e in interactive.endpoints) + tuple(e.url for e in batch.endpoints)
    count = engines if engines is not None else len(urls)
    if not 2 <= count <= MAX_ENGINES:
        raise ValueError(f"{count} engines: advise splits 2 to {MAX_ENGINES} engines (give --engines)")
    return Fleet(count, _plan(interactive), _plan(batch), config, urls)
