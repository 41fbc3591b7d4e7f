"""The set-ups a replay runs: which engines, and whether a router (and which config) is in front of them.

``bench sweep`` and ``bench trace`` build theirs from these; ``tailguard
advise`` builds one per candidate from the operator's file. The pools' and
classes' settings are the shipped ``config.toml``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tailguard.router.config import (
    ClassConfig,
    Config,
    EndpointConfig,
    EstimateConfig,
    LimitsConfig,
    PoolConfig,
    ServerConfig,
    TimeoutsConfig,
)
from tailguard.sim.params import PROFILES
from tailguard.sim.server import DEFAULT_MODEL

from .mix import CLASSES

INTERACTIVE_QUEUE_TIMEOUT = 3.0  # config.toml
BATCH_QUEUE_TIMEOUT = 110.0  # config.toml
INTERACTIVE_MAX_QUEUE = 256  # config.toml
BATCH_MAX_QUEUE = 4096  # config.toml
SEATS = {name: params.max_num_seqs for name, params in PROFILES.items()}


@dataclass(frozen=True)
class Setup:
    """A fleet of engines and how requests reach them.

    ``direct`` sends each class straight to its engines, round robin by
    arrival index (no router); otherwise ``config`` puts a Router in front.
    ``kinds`` are the arrival kinds sent at all (short-only drops "long").
    """

    name: str
    engines: tuple[tuple[str, str], ...]  # (url, profile)
    direct: Mapping[str, tuple[str, ...]] | None = None
    config: Config | None = None
    kinds: tuple[str, ...] = CLASSES
    description: str = ""


def _urls(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"http://{prefix}-{i}:8000" for i in range(count))


def shared(engines: int, *, name: str = "shared", kinds: tuple[str, ...] = CLASSES) -> Setup:
    """Round robin straight to throughput engines: one FIFO batch per GPU, what people run today."""
    urls = _urls("tp", engines)
    return Setup(
        name,
        tuple((url, "throughput") for url in urls),
        direct={kind: urls for kind in CLASSES},
        kinds=kinds,
        description=f"no router, round robin over {engines} throughput engine(s)"
        + ("" if kinds == CLASSES else f", {'+'.join(kinds)} requests only"),
    )


def _classes(interactive_pool: str, batch_pool: str) -> tuple[ClassConfig, ...]:
    """The shipped classes: interactive = prompt <= 500 and max_tokens <= 128, batch the rest."""
    return (
        ClassConfig("interactive", interactive_pool, INTERACTIVE_QUEUE_TIMEOUT, 0, 500, 128),
        ClassConfig("batch", batch_pool, BATCH_QUEUE_TIMEOUT, 1),
    )


def _pool(name: str, urls: Sequence[str], profile: str, max_queue: int) -> PoolConfig:
    seats = SEATS[profile]
    endpoints = tuple(EndpointConfig(url, seats) for url in urls)
    return PoolConfig(name, endpoints, seats * len(urls), max_queue, 32768, (DEFAULT_MODEL,), profile)  # type: ignore[arg-type]


def _config(pools: tuple[PoolConfig, ...], classes: tuple[ClassConfig, ...]) -> Config:
    return Config(ServerConfig(), EstimateConfig(), LimitsConfig(), TimeoutsConfig(), pools, classes, digest="sweep")


def priority(engines: int) -> Setup:
    """The origin's fix: one pool of all engines, interactive (prio 0) queued ahead of batch (prio 1)."""
    urls = _urls("tp", engines)
    pool = _pool("shared", urls, "throughput", INTERACTIVE_MAX_QUEUE + BATCH_MAX_QUEUE)
    return Setup(
        "priority",
        tuple((url, "throughput") for url in urls),
        config=_config((pool,), _classes("shared", "shared")),
        description=f"router, one pool of {engines} throughput engines (cap = seats), short-first priority",
    )


def disaggregated(interactive: int, batch: int, *, name: str | None = None) -> Setup:
    """tailguard's answer: latency engines for the interactive class, throughput engines for batch."""
    fast, slow = _urls("lat", interactive), _urls("tp", batch)
    pools = (
        _pool("interactive", fast, "latency", INTERACTIVE_MAX_QUEUE),
        _pool("batch", slow, "throughput", BATCH_MAX_QUEUE),
    )
    return Setup(
        name or f"disaggregated {interactive}:{batch}",
        tuple((url, "latency") for url in fast) + tuple((url, "throughput") for url in slow),
        config=_config(pools, _classes("interactive", "batch")),
        description=f"router, interactive pool of {interactive} latency engine(s), batch pool of {batch} throughput engine(s)",
    )


def split_direct(interactive: int, batch: int) -> Setup:
    """The disaggregated fleet without the router: each class sent straight to its engines."""
    fast, slow = _urls("lat", interactive), _urls("tp", batch)
    return Setup(
        "split direct",
        tuple((url, "latency") for url in fast) + tuple((url, "throughput") for url in slow),
        direct={"short": fast, "long": slow},
        description="no router: short requests to the latency engine(s), long ones to the throughput engine(s)",
    )
