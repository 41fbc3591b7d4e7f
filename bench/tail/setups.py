"""The tail benchmark's set-ups: which engines each runs, tailguard's config for it, and its capacity."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from bench.harness.config import PoolSpec, classes_tables, pools_table, server_table
from bench.harness.procs import free_ports
from bench.harness.toml import TomlTable, dumps, merged
from bench.tail.model import BASELINES, END_TO_END_TIMEOUT, LEND_BACK, QUEUE_TIMEOUTS, SETUP_NAMES, SPLIT_KINDS, LendRule, Options, Setup
from tailguard.server.advise.replay.mix import pooled_capacity
from tailguard.sim.params import PROFILES, EngineParams


def engine_params(options: Options, profile: str) -> EngineParams:
    """The profile's engine, with ``--seats`` as its max_num_seqs when given."""
    params = PROFILES[profile]
    return params.replace(max_num_seqs=options.seats) if options.seats else params


Plan = tuple[str, tuple[int, int] | None, LendRule | None, int | None]  # kind, split, lending rule, batch seats


def build_plans(options: Options) -> list[Plan]:
    """Every set-up to run, in SETUP_NAMES order: each split set-up on each split, lend on each rule, shared-limit on each limit."""
    plans: list[Plan] = []
    splits = options.splits or [options.split]
    for kind in SETUP_NAMES:
        if kind not in options.setups:
            continue
        if kind in SPLIT_KINDS:
            rules: Sequence[LendRule | None] = options.lend_rules if kind == "lend" else [options.lend_rules[0]] if kind == "lend-rebalance" else [None]
            plans += [(kind, split, rule, None) for split in splits for rule in rules]
        elif kind == "shared-limit":
            plans += [(kind, None, None, seats) for seats in options.batch_seats]
        else:
            plans.append((kind, None, None, None))
    return plans


def build_setups(options: Options, baseline_copies: int = 0) -> list[Setup]:
    """The chosen set-ups, each on simulated engines of its own (ports picked here, all at once so they differ).

    ``baseline_copies`` more of each baseline (shared, short-only), named
    "shared #2" and so on, for rounds that carry baselines of their own.
    """
    plans = build_plans(options)
    copies = [(kind, copy) for copy in range(2, baseline_copies + 2) for kind in BASELINES if kind in options.setups]
    ports = iter(free_ports(options.engines * (len(plans) + len(copies))))
    setups = [_setup(options, kind, split, rule, limit, [next(ports) for _ in range(options.engines)]) for kind, split, rule, limit in plans]
    for kind, copy in copies:
        setup = _setup(options, kind, None, None, None, [next(ports) for _ in range(options.engines)])
        setups.append(dataclasses.replace(setup, name=f"{setup.name} #{copy}"))
    return setups


def _setup(options: Options, kind: str, split: tuple[int, int] | None, rule: LendRule | None, limit: int | None, ports: list[int]) -> Setup:
    """One set-up of ``kind`` on ``ports`` (as many as --engines)."""
    n = len(ports)
    seats = {profile: engine_params(options, profile).max_num_seqs for profile in ("latency", "throughput")}
    name = kind
    if split is not None and len(options.splits) > 1:
        name += f" {split[0]}:{split[1]}"
    if rule is not None and kind == "lend" and len(options.lend_rules) > 1:
        name += f" [{rule.label()}]"
    throughput = [(p, "throughput") for p in ports]
    cap = seats["throughput"]
    everything = PoolSpec("all", [(p, cap) for p in ports], cap * n, 512 * n)
    if kind == "shared":
        return Setup(name, f"{n} throughput engine(s), client round robin, no router", direct=ports, kind=kind, engines=throughput)
    if kind == "short-only":
        return Setup(name, "shared without the long requests: the ideal", direct=ports, drop_long=True, kind=kind, engines=throughput)
    if kind == "priority":
        return Setup(
            name, f"tailguard, one pool of {n} throughput engine(s), interactive before batch",
            pools=[everything], class_pool={"interactive": "all", "batch": "all"}, kind=kind, engines=throughput,
        )
    if kind == "shared-limit":
        assert limit is not None
        pool = dataclasses.replace(everything, extra={"class_max_concurrency": {"batch": limit * n}})
        return Setup(
            f"{name} [batch<={limit * n}]", f"priority's pool; batch holds at most {limit * n} of its {cap * n} seats",
            pools=[pool], class_pool={"interactive": "all", "batch": "all"}, kind=kind, engines=throughput,
        )
    if kind == "vllm-priority":
        # Twice the engine's seats per endpoint: what waits inside vLLM is what its priority scheduler orders
        # (V1 never preempts for a waiter; docs/vllm-priority.md), so at cap = seats the flag would change nothing.
        pool = PoolSpec("all", [(p, 2 * cap) for p in ports], 2 * cap * n, 512 * n, {"vllm_priority": True})
        return Setup(
            name, f"priority's pool at {2 * cap} a engine (twice its seats), class priority sent to vLLM's priority scheduler "
            "(engines --scheduling-policy priority)",
            pools=[pool], class_pool={"interactive": "all", "batch": "all"}, kind=kind, engines=throughput, scheduling="priority",
        )
    assert split is not None
    interactive, batch = split
    latency_ports, batch_ports = ports[:interactive], ports[interactive:]
    fast = options.interactive_profile  # "latency", or the batch pool's own tuning
    engines = [(p, fast) for p in latency_ports] + [(p, "throughput") for p in batch_ports]
    if kind == "split-direct":
        return Setup(
            name,
            f"disaggregated's split with no router: short round robin to {interactive} latency engine(s), "
            f"long to {batch} throughput engine(s), tailguard's forwarded bodies",
            by_kind={"short": latency_ports, "long": batch_ports}, kind=kind, engines=engines, split=split,
        )
    pools = [
        PoolSpec("interactive", [(p, seats[fast]) for p in latency_ports], seats[fast] * interactive, 256 * interactive),
        PoolSpec("batch", [(p, seats["throughput"]) for p in batch_ports], seats["throughput"] * batch, 512 * batch),
    ]
    tables: TomlTable = {}
    what = f"tailguard, interactive pool {interactive} latency engine(s), batch pool {batch} throughput engine(s)"
    if kind in ("lend", "lend-rebalance"):
        assert rule is not None
        tables = rule.table("interactive", "batch", options.time_scale)
        what += f"; interactive lends to batch ({rule.label()})"
        if options.lend_back:
            tables = merged(tables, LEND_BACK.table("batch", "interactive"))
            what += ", batch lends to interactive whenever its engine is the less busy (as config.toml)"
    if kind in ("rebalance", "lend-rebalance"):
        tables = merged(tables, options.rebalance.table(options.time_scale))
        what += "; every endpoint movable, [rebalance]"
    return Setup(
        name, what, pools=pools, class_pool={"interactive": "interactive", "batch": "batch"}, kind=kind, engines=engines,
        split=split, tables=tables, movable=kind in ("rebalance", "lend-rebalance"),
    )


def router_config(
    http_port: int, grpc_port: int, setup: Setup, time_scale: float, fail_fast_fraction: float | None = None, batch_relay_interval: float = 0.0
) -> str:
    """A tailguard config for ``setup``: the shipped classes, timeouts scaled to GPU time.

    ``fail_fast_fraction`` is written into every pool when given (else the
    router's default applies, and the key is left out so an older router
    reads the same file). The set-up's own tables (lending, rebalancing)
    follow the pools; ``movable`` marks every endpoint movable.
    """
    fail_fast: TomlTable = {} if fail_fast_fraction is None else {"fail_fast_fraction": fail_fast_fraction}
    pools = [dataclasses.replace(pool, extra={**pool.extra, **fail_fast}, movable=setup.movable) for pool in setup.pools]
    timeouts = {"timeouts": {"end_to_end_timeout": END_TO_END_TIMEOUT * time_scale}}
    relay = {"batch": batch_relay_interval * time_scale} if batch_relay_interval else None
    classes = classes_tables(setup.class_pool, {name: QUEUE_TIMEOUTS[name] * time_scale for name in ("interactive", "batch")}, relay)
    return dumps(merged(server_table(http_port, grpc_port), timeouts, pools_table(*pools), setup.tables, classes))


def capacities(options: Options, mix: dict[str, list[tuple[float, int, int]]]) -> dict[str, float]:
    """Each set-up kind's modelled capacity (total req/s, GPU time) for ``mix``, on the first split."""
    shapes = [shape for group in mix.values() for shape in group]
    shared = pooled_capacity(options.engines, engine_params(options, "throughput"), shapes)
    return {
        "shared": shared,
        "priority": shared,
        "shared-limit": shared,
        "vllm-priority": shared,
        "disaggregated": split_capacity(options.split, mix, options),
        "split-direct": split_capacity(options.split, mix, options),
        "short-only": pooled_capacity(options.engines, engine_params(options, "throughput"), mix.get("short", [])),
    }


def setup_capacity(setup: Setup, options: Options, mix: dict[str, list[tuple[float, int, int]]], caps: dict[str, float]) -> float:
    """The set-up's modelled capacity: its split's when it has one (work conservation not modelled), else its kind's."""
    if setup.split is not None:
        return split_capacity(setup.split, mix, options)
    return caps[setup.kind]


def split_capacity(split: tuple[int, int], mix: dict[str, list[tuple[float, int, int]]], options: Options | None = None) -> float:
    """The arrival rate at which the first of the two pools is full."""
    latency = engine_params(options, options.interactive_profile) if options else PROFILES["latency"]
    throughput = engine_params(options, "throughput") if options else PROFILES["throughput"]
    if split[0] == 0 or split[1] == 0:
        return math.nan
    interactive = pooled_capacity(split[0], latency, mix.get("short", []))
    return min(interactive, pooled_capacity(split[1], throughput, mix.get("long", [])))
