"""The set-ups a trace is replayed through, by name: the two baselines and tailguard's candidates.

A set-up is a factory ``(engines, split, config) -> Setup``: ``split`` is
the hand split's (interactive, batch) engines and ``config`` the file whose
classes and lend rules tailguard follows (the shipped ``config.toml`` by
default). Add a candidate by adding an entry to ``SETUPS`` (and to
``DEFAULT_SETUPS`` if a plain run should have it). Every routed
set-up has its input cap raised to the engines' context, so the router
refuses what the engines would, no more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from tailguard.router.config import Config, LendConfig, LimitsConfig, RebalanceConfig, load_config
from tailguard.server.advise.replay.setups import SEATS, Setup, disaggregated, priority, shared, split_direct

from .load import CONTEXT, thresholds

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "config.toml"

SetupFactory = Callable[[int, tuple[int, int], Config], Setup]


def default_split(engines: int) -> tuple[int, int]:
    """A quarter of the engines (at least one) for the interactive class: 1:1 at 2 engines, 1:3 at 4."""
    interactive = max(1, engines // 4)
    return interactive, engines - interactive


def lend_rules(path: Path = SHIPPED_CONFIG) -> dict[str, LendConfig]:
    """Each pool's ``[pools.NAME.lend]`` as ``path`` has it, so the bench lends as an install of that file would."""
    return lend_rules_of(load_config(path))


def lend_rules_of(config: Config) -> dict[str, LendConfig]:
    """Each pool's lend rule in ``config``, by pool name."""
    return {pool.name: pool.lend for pool in config.pools}


def routed_like(setup: Setup, config: Config | None = None, *, name: str | None = None) -> Setup:
    """``setup`` with the input cap at the context and, given ``config``, its classes as that file has them:
    the interactive class's bounds, and each class's queue_timeout and objective (the short class's from the
    file's first class, the long one's from its catch-all, the last)."""
    assert setup.config is not None
    routed = setup.config
    classes = routed.classes
    if config is not None:
        bounds = thresholds(config)
        short, long = config.classes[0], config.classes[-1]
        first = dataclasses.replace(
            classes[0], max_prompt_tokens=bounds.prompt, max_output_tokens=bounds.output, queue_timeout=short.queue_timeout, objective=short.objective
        )
        rest = [dataclasses.replace(c, queue_timeout=long.queue_timeout, objective=long.objective) for c in classes[1:]]
        classes = (first, *rest)
    limits = LimitsConfig(input_cap_tokens=CONTEXT - 1, output_cap_tokens=CONTEXT - 1)
    return dataclasses.replace(setup, name=name or setup.name, config=dataclasses.replace(routed, limits=limits, classes=classes))


def tailguard_split(interactive: int, batch: int, lend: dict[str, LendConfig] | None = None, config: Config | None = None) -> Setup:
    """tailguard over the split, its pools lending under ``lend`` (default: the shipped config's rules); given
    ``config``, its pools' queue bounds and its classes' timeouts and objectives too (``routed_like``)."""
    lend = lend_rules() if lend is None else lend
    setup = disaggregated(interactive, batch, name=f"tailguard {interactive}:{batch}")
    assert setup.config is not None
    queues = {} if config is None else {pool.name: pool.max_queue for pool in config.pools}
    pools = tuple(
        dataclasses.replace(pool, lend=lend.get(pool.name, LendConfig()), max_queue=queues.get(pool.name, pool.max_queue)) for pool in setup.config.pools
    )
    return routed_like(dataclasses.replace(setup, config=dataclasses.replace(setup.config, pools=pools)), config)


def _round_robin(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return shared(engines, name="round robin")


def _hand_split(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return dataclasses.replace(split_direct(*split), name=f"hand split {split[0]}:{split[1]}")


def on_profiles(setup: Setup, profiles: dict[str, str]) -> Setup:
    """``setup`` with each pool's engines (and seats) on the profile ``profiles`` names for it; others as they are."""
    assert setup.config is not None
    pools = tuple(
        dataclasses.replace(
            pool,
            endpoints=tuple(dataclasses.replace(e, max_concurrency=SEATS[profile]) for e in pool.endpoints),
            max_concurrency=SEATS[profile] * len(pool.endpoints),
            simulate_profile=profile,  # type: ignore[arg-type]
        )
        for pool in setup.config.pools
        for profile in [profiles.get(pool.name, pool.simulate_profile)]
    )
    engine_profile = {e.url: pool.simulate_profile for pool in pools for e in pool.endpoints}
    engines = tuple((url, engine_profile.get(url, profile)) for url, profile in setup.engines)
    return dataclasses.replace(setup, engines=engines, config=dataclasses.replace(setup.config, pools=pools))


def placed_as(setup: Setup, config: Config) -> Setup:
    """``setup`` with each pool that ``config`` names placing as it says there (``placement``, its load bound, ...)."""
    assert setup.config is not None
    placements = {pool.name: pool.placement for pool in config.pools}
    pools = tuple(dataclasses.replace(pool, placement=placements.get(pool.name, pool.placement)) for pool in setup.config.pools)
    return dataclasses.replace(setup, config=dataclasses.replace(setup.config, pools=pools))


def _tailguard(engines: int, split: tuple[int, int], config: Config) -> Setup:
    """The split's engines tuned as ``config``'s pools say (``simulate_profile``): the shipped file runs vLLM's defaults
    on both; its pools place as the file says."""
    setup = placed_as(tailguard_split(*split, lend_rules_of(config), config), config)
    return on_profiles(setup, {pool.name: pool.simulate_profile for pool in config.pools})


def _tailguard_latency(engines: int, split: tuple[int, int], config: Config) -> Setup:
    """The same, its interactive engines tuned for latency (64 seats, 2,048-token steps): what the file shipped before."""
    setup = on_profiles(_tailguard(engines, split, config), {"interactive": "latency"})
    return dataclasses.replace(setup, name=f"{setup.name}, latency-tuned interactive")


# [rebalance] for a trace's span: a point replays 110 to 560 s of traffic, so the shipped hold_time 30 s and
# cooldown 60 s would allow one or two moves at most. A sixth of each (5 s, 10 s; interval and threshold as
# shipped) lets a point make the ~10 moves the shipped values make in an hour-long run of the same traffic.
HOLD_TIME = 5.0
COOLDOWN = 10.0
SEAT_STEP = 0.25


def rebalancing(setup: Setup, settings: RebalanceConfig, *, name: str) -> Setup:
    """``setup`` with every pool ``rebalance = "auto"``, every endpoint movable, and ``settings`` as its ``[rebalance]``."""
    assert setup.config is not None
    pools = tuple(
        dataclasses.replace(pool, rebalance="auto", endpoints=tuple(dataclasses.replace(e, movable=True) for e in pool.endpoints))
        for pool in setup.config.pools
    )
    return dataclasses.replace(setup, name=name, config=dataclasses.replace(setup.config, pools=pools, rebalance=settings))


def _trace_rebalance(config: Config, seat_step: float) -> RebalanceConfig:
    """``config``'s ``[rebalance]`` with hold_time and cooldown scaled to a trace's span, moving ``seat_step`` of an engine."""
    return dataclasses.replace(config.rebalance, hold_time=HOLD_TIME, cooldown=COOLDOWN, seat_step=seat_step)


def _tailguard_moves(engines: int, split: tuple[int, int], config: Config) -> Setup:
    """The shipped set-up, its engines movable between the pools as whole engines."""
    setup = _tailguard(engines, split, config)
    return rebalancing(setup, _trace_rebalance(config, 1.0), name=f"{setup.name}, moves")


def _tailguard_shares(engines: int, split: tuple[int, int], config: Config) -> Setup:
    """The same, moving a quarter of an engine's seats at a time (seat shares)."""
    setup = _tailguard(engines, split, config)
    return rebalancing(setup, _trace_rebalance(config, SEAT_STEP), name=f"{setup.name}, seat shares {SEAT_STEP:g}")


def _tailguard_shared(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return routed_like(priority(engines), config, name="tailguard shared")


ROUND_ROBIN, HAND_SPLIT = "rr", "split"
SETUPS: dict[str, SetupFactory] = {
    ROUND_ROBIN: _round_robin,  # no router: round robin over throughput engines
    HAND_SPLIT: _hand_split,  # no router: each class straight to its own engines
    "tailguard": _tailguard,  # the hand split's engines as tailguard's pools, tuned and lending as the config says
    "tailguard-latency": _tailguard_latency,  # the same, its interactive engines latency-tuned
    "tailguard-shared": _tailguard_shared,  # one pool of every engine, short requests queued first
    "tailguard-moves": _tailguard_moves,  # tailguard, its engines moved whole between the pools by rebalancing
    "tailguard-shares": _tailguard_shares,  # tailguard, a quarter of an engine's seats moved at a time
}
BASELINES = (ROUND_ROBIN, HAND_SPLIT)  # every run has them: the ratios are against them
DEFAULT_SETUPS = (ROUND_ROBIN, HAND_SPLIT, "tailguard", "tailguard-latency", "tailguard-shared")  # a plain run's (trace.md)
