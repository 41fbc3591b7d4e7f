"""The set-ups a trace is replayed through, by name: the two baselines and tailguard's candidates.

A set-up is a factory ``(engines, split, config) -> Setup``: ``split`` is
the hand split's (interactive, batch) engines and ``config`` the file whose
classes and lend rules tailguard follows (the shipped ``config.toml`` by
default). Add a candidate by adding an entry to ``SETUPS``. Every routed
set-up has its input cap raised to the engines' context, so the router
refuses what the engines would, no more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from tailguard.router.config import load_config
from tailguard.router.config_types import Config, LendConfig, LimitsConfig
from tailguard.sim.virtual.fleet import SEATS, Setup, disaggregated, priority, shared, split_direct

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
    """``setup`` with the input cap at the context and, given ``config``, the interactive class's bounds from it."""
    assert setup.config is not None
    routed = setup.config
    classes = routed.classes
    if config is not None:
        bounds = thresholds(config)
        first = dataclasses.replace(classes[0], max_prompt_tokens=bounds.prompt, max_output_tokens=bounds.output)
        classes = (first, *classes[1:])
    limits = LimitsConfig(input_cap_tokens=CONTEXT - 1, output_cap_tokens=CONTEXT - 1)
    return dataclasses.replace(setup, name=name or setup.name, config=dataclasses.replace(routed, limits=limits, classes=classes))


def tailguard_split(interactive: int, batch: int, lend: dict[str, LendConfig] | None = None) -> Setup:
    """tailguard over the split, its pools lending under ``lend`` (default: the shipped config's rules)."""
    lend = lend_rules() if lend is None else lend
    setup = disaggregated(interactive, batch, name=f"tailguard {interactive}:{batch}")
    assert setup.config is not None
    pools = tuple(dataclasses.replace(pool, lend=lend.get(pool.name, LendConfig())) for pool in setup.config.pools)
    return routed_like(dataclasses.replace(setup, config=dataclasses.replace(setup.config, pools=pools)))


def _round_robin(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return shared(engines, name="round robin")


def _hand_split(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return dataclasses.replace(split_direct(*split), name=f"hand split {split[0]}:{split[1]}")


def _tailguard(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return routed_like(tailguard_split(*split, lend_rules_of(config)), config)


def on_throughput_engines(setup: Setup) -> Setup:
    """``setup`` with every engine and pool on the throughput profile: vLLM's default flags, no engine tuned for latency."""
    assert setup.config is not None
    seats = SEATS["throughput"]
    pools = tuple(
        dataclasses.replace(
            pool,
            endpoints=tuple(dataclasses.replace(e, max_concurrency=seats) for e in pool.endpoints),
            max_concurrency=seats * len(pool.endpoints),
            simulate_profile="throughput",
        )
        for pool in setup.config.pools
    )
    engines = tuple((url, "throughput") for url, _ in setup.engines)
    return dataclasses.replace(setup, engines=engines, config=dataclasses.replace(setup.config, pools=pools))


def _tailguard_even(engines: int, split: tuple[int, int], config: Config) -> Setup:
    setup = on_throughput_engines(_tailguard(engines, split, config))
    return dataclasses.replace(setup, name=f"tailguard {split[0]}:{split[1]}, throughput engines")


def _tailguard_shared(engines: int, split: tuple[int, int], config: Config) -> Setup:
    return routed_like(priority(engines), config, name="tailguard shared")


ROUND_ROBIN, HAND_SPLIT = "rr", "split"
SETUPS: dict[str, SetupFactory] = {
    ROUND_ROBIN: _round_robin,  # no router: round robin over throughput engines
    HAND_SPLIT: _hand_split,  # no router: each class straight to its own engines
    "tailguard": _tailguard,  # the hand split's engines as tailguard's pools, lending as the config says
    "tailguard-even": _tailguard_even,  # the same pools, every engine on the throughput profile
    "tailguard-shared": _tailguard_shared,  # one pool of every engine, short requests queued first
}
BASELINES = (ROUND_ROBIN, HAND_SPLIT)  # every run has them: the ratios are against them
