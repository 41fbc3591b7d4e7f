"""``python -m bench tail``: short requests' P99 under mixed load, five set-ups on the same engines and traffic.

Real time, open loop, on 127.0.0.1: one simulator process serves N
throughput-profile engines plus I latency-profile ones; tailguard runs in
its own process, started afresh for each set-up that uses it. The same
seeded arrivals are played against, one after another:

- ``shared``: all N throughput engines, client round robin, one FIFO per engine, no caps (no router);
- ``priority``: tailguard, ONE pool of the N throughput engines (cap 256 each), both classes routed to it,
  interactive priority 0 before batch priority 1, queue timeouts and deadlines (the origin's fix);
- ``disaggregated``: tailguard's default, ``--split I:B`` (I + B = N): an interactive pool of I
  latency engines (cap 64 each), a batch pool of B throughput engines (cap 256 each);
- ``split-direct``: ``disaggregated``'s exact split fed by the client with no router: each short request
  round robin to the I latency engines, each long one to the B throughput engines, each body the one
  tailguard would forward (its model, max_tokens after the output cap), so the difference from
  ``disaggregated`` is the router's own added latency;
- ``short-only``: ``shared`` with the long requests removed: the ideal short P99.

Work-conserving set-ups (issue 12), on ``disaggregated``'s split unless said:

- ``lend``: the interactive pool lends idle seats to batch requests under a rule
  (``--lend-rule``: prefill budget, reserve, seats at most; one set-up per rule),
  and the batch pool lends its idle seats to interactive requests (``--no-lend-back`` turns that off);
- ``rebalance``: every endpoint ``movable = true`` and a ``[rebalance]`` section (hold time,
  cooldown, threshold in GPU s, ``--hold``/``--cooldown``/``--threshold``);
- ``lend-rebalance``: both, with the first ``--lend-rule``;
- ``shared-limit``: ``priority``'s one pool with ``class_max_concurrency`` for batch (``--batch-seats``, one set-up each);
- ``vllm-priority``: ``priority``'s one pool with ``vllm_priority = true``, its engines run with the
  simulator's ``--scheduling-policy priority``.

Every set-up gets engines of its own, so ``--max-engines`` can run several set-ups at once
(each still alone on its engines; only the CPU is shared, and the report says how busy it was).
``--mix`` picks the traffic: the origin's, ``chat`` (short requests take most of the GPU time),
or ``shift`` (``chat`` then the origin's, ``--phase-seconds`` each).

The load is a fraction of the ``shared`` set-up's capacity for the traffic's
mix, computed from the engine model (``tailguard.sim.virtual.mix.engine_capacity``);
every set-up's own modelled capacity is reported beside it. Latencies are
GPU time (real divided by ``--time-scale``); tailguard's timeouts are scaled
by the same factor so its deadlines mean what they say in GPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import trio

from bench.harness.cli import add_out_arg, add_seed_arg, add_time_scale_arg, driver_parser, run_trio
from bench.harness.client import CHAT_PATH, HOST, ProtocolError, engine_counts, http_request
from bench.harness.clocks import CpuClock
from bench.harness.config import PoolSpec, classes_tables, server_table
from bench.harness.open_loop import (
    FAST_REJECTION_MS,
    ClassStats,
    Sample,
    TokenClient,
    TokenPool,
    class_stats,
    play,
    token_times,
    write_samples,
)
from bench.harness.procs import RESULTS_ROOT, free_ports, log_tail, process_cpu_seconds, start_process, start_tailguard, stop, wait_ready
from bench.harness.report import md_table, write_json
from bench.tail.plot import plot_cdfs, plot_p99_vs_load, plot_shift, plot_timelines, plot_tradeoff
from tailguard.router.config_types import LimitsConfig
from tailguard.router.limits import effective_max_tokens
from tailguard.sim.params import PROFILES, EngineParams
from tailguard.sim.virtual.mix import CLASSES, MIXES, Shape, body_for, percentile, pooled_capacity, shapes_by_class
from tailguard.sim.virtual.trace import Arrival, generated, mix_of, phased, read_trace, write_trace

T = TypeVar("T")

RESULTS = RESULTS_ROOT / "tail"
DEFAULT_SETUPS = ("shared", "priority", "disaggregated", "split-direct", "short-only")
SETUP_NAMES = (*DEFAULT_SETUPS, "lend", "rebalance", "lend-rebalance", "shared-limit", "vllm-priority")
SPLIT_KINDS = ("disaggregated", "split-direct", "lend", "rebalance", "lend-rebalance")  # set-ups on the I:B split
TAILGUARD_SPLIT_KINDS = ("disaggregated", "lend", "rebalance", "lend-rebalance")
BASELINES = ("shared", "short-only")  # what the others are measured against (--baselines-each-round copies them)
ENGINE_PROBE_S = 0.5  # real s between two looks at every engine's running and waiting counts
MODEL = "sim-llama-3.1-8b"  # the model every generated pool serves (PoolSpec.toml), which tailguard names in its body
ADDED_TTFT_GOAL_MS = 10.0  # real ms: short TTFT P99 through tailguard over the same split fed directly, at load 0.8
SHORT_DEADLINE_S = 3.0  # GPU s: the interactive class's queue_timeout in the shipped config
QUEUE_TIMEOUTS = {"interactive": 3.0, "batch": 30.0}  # GPU s, as shipped
_CLASS_OF = {"short": "interactive", "long": "batch"}  # reporting class -> tailguard class
END_TO_END_TIMEOUT = 120.0
PROBE_S = 2.0  # real s between two looks at the router (memory, CPU, sockets, queue)
ROUTER_LOG_LEVEL = "INFO"  # the shipped default: the access log is on (it times every rejection)


@dataclass(frozen=True)
class LendRule:
    """What the interactive pool lends the batch pool (``[pools.interactive.lend]``); None: no bound."""

    max_prompt_tokens: int | None = None  # the prefill budget: the stall a borrowed prompt may add to a step
    reserve: int = 0  # seats kept free for interactive requests
    max_seats: int | None = None  # lent at once at most
    max_output_tokens: int | None = None  # how long a lent seat may be away

    _KEYS = {"prompt": "max_prompt_tokens", "reserve": "reserve", "seats": "max_seats", "output": "max_output_tokens"}

    @classmethod
    def parse(cls, text: str) -> LendRule:
        """``prompt=512,reserve=8,seats=32,output=512`` (any of them; "none" or absent: unbounded)."""
        values: dict[str, int | None] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in cls._KEYS:
                raise ValueError(f"--lend-rule {text!r}: {key!r} is not one of {', '.join(cls._KEYS)}")
            values[cls._KEYS[key]] = None if value in ("none", "") else int(value)
        if values.get("reserve") is None:
            values["reserve"] = 0
        return cls(**values)  # type: ignore[arg-type]

    def label(self) -> str:
        """Short name: p512 r8 s32 o512 (p- = no prefill budget)."""
        prompt = "-" if self.max_prompt_tokens is None else str(self.max_prompt_tokens)
        parts = [f"p{prompt}", f"r{self.reserve}"]
        parts += [f"s{self.max_seats}"] if self.max_seats is not None else []
        parts += [f"o{self.max_output_tokens}"] if self.max_output_tokens is not None else []
        return " ".join(parts)

    def toml(self, lender: str, borrower: str) -> list[str]:
        lines = [f"[pools.{lender}.lend]", f'to = ["{borrower}"]', f"reserve = {self.reserve}"]
        for key in ("max_seats", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, key)
            if value is not None:
                lines.append(f"{key} = {value}")
        return [*lines, ""]


# The default lending rule, chosen by measurement (bench/results/tail/tail-issue12.md): a borrowed
# prompt of at most 512 tokens adds at most 512 / 25 = 20 GPU ms to one step of a latency engine
# (prefill at 25 tokens/ms); a 2,021-token document adds 81 ms, and a few of those in a short
# request's life were enough to double its P99 on 2 engines.
DEFAULT_LEND = LendRule(max_prompt_tokens=512, reserve=4)


@dataclass(frozen=True)
class RebalanceSpec:
    """``[rebalance]`` in GPU seconds (the config gets them times the time scale)."""

    interval: float = 0.25
    hold: float = 3.0
    threshold: float = 0.3
    cooldown: float = 6.0

    def toml(self, scale: float) -> list[str]:
        return [
            "[rebalance]",
            f"interval = {self.interval * scale:g}",
            f"hold_time = {max(self.hold, self.interval) * scale:g}",
            f"threshold = {self.threshold:g}",
            f"cooldown = {self.cooldown * scale:g}",
            "",
        ]


@dataclass(frozen=True)
class Options:
    engines: int
    split: tuple[int, int]
    loads: Sequence[float]
    traffic: str  # poisson | bursty
    burst_period: float  # real s, bursty only
    trace: Path | None
    record_trace: Path | None
    warmup: float
    seconds: float
    drain: float
    time_scale: float
    seed: int
    setups: Sequence[str]
    out: Path
    name: str
    fail_fast_fraction: float | None = None  # pools.*.fail_fast_fraction in the router's config; None: the default
    samples_dir: Path | None = None  # write every request's fate there (JSONL per set-up and load)
    splits: Sequence[tuple[int, int]] = ()  # every I:B split for the split set-ups (the first is ``split``)
    mix: str = "origin"  # origin | chat | shift
    seats: int | None = None  # every engine's max_num_seqs (the simulator's override); None: the profiles'
    lend_rules: Sequence[LendRule] = (DEFAULT_LEND,)
    lend_back: bool = True  # the batch pool lends idle seats to interactive requests in the lend set-ups
    batch_relay_interval: float = 0.0  # the batch class's relay_interval, GPU seconds (0: each event as it comes)
    rebalance: RebalanceSpec = RebalanceSpec()
    batch_seats: Sequence[int] = (16,)  # shared-limit: batch's class_max_concurrency per endpoint, one set-up each
    max_engines: int = 0  # run set-ups at once while their engines add up to at most this; 0: one at a time
    phase_seconds: float = 0.0  # shift: real s of each phase
    bin_seconds: float = 0.0  # GPU s per bin of the over-time series; 0: none (shift: 2)
    baselines_each_round: bool = False  # with max_engines: every round runs its own shared and short-only


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    pools: Sequence[PoolSpec] = ()  # tailguard's pools; empty = no router
    class_pool: dict[str, str] = field(default_factory=dict)  # tailguard class -> pool
    direct: Sequence[int] = ()  # without a router: the engines, round robin
    drop_long: bool = False
    by_kind: dict[str, Sequence[int]] = field(default_factory=dict)  # without a router: each reporting class's engines
    kind: str = ""  # one of SETUP_NAMES (``name`` may add the split and the rule)
    engines: Sequence[tuple[int, str]] = ()  # (port, profile): the simulated GPUs this set-up runs on, its own
    split: tuple[int, int] | None = None
    tables: Sequence[str] = ()  # more config lines after the pools: lend tables, [rebalance]
    movable: bool = False  # every endpoint ``movable = true``
    scheduling: str = "fcfs"  # the engines' scheduling policy (one simulator process per policy)


@dataclass(frozen=True)
class Probe:
    """One look at the router process during a run (real time)."""

    t: float  # s since the set-up's first arrival was due
    rss_mib: float
    peak_rss_mib: float  # the kernel's high-water mark (VmHWM), so no peak between looks is missed
    cores: float  # the router's CPU since the previous look
    cpu_wait: float  # share of the time since the previous look its event-loop thread was runnable but had no CPU
    fds: int  # open file descriptors: client connections + backend connections + a few
    waiting: float | None  # tailguard_pool_queue_length summed over pools (None: /metrics did not answer)
    in_flight: float | None  # tailguard_pool_in_flight summed over pools
    health_ms: float | None  # how long GET /health took: the router's responsiveness (None: over 1 s)
    gc: tuple[float, float, float] | None = None  # GC pauses so far, all generations: (count, over 10 ms, total s)
    assignment: dict[str, int] | None = None  # endpoints per pool now (tailguard_endpoint_assignment)
    moving: int = 0  # endpoints between pools now (tailguard_endpoint_moving)
    lent: float = 0.0  # seats lent now, all pools (tailguard_pool_lent_seats)
    borrowed: float = math.nan  # requests seated on a lender's seat so far, all pools (tailguard_pool_borrowed_total)


@dataclass
class EngineWatch:
    """Every engine's own running and waiting counts (vllm:num_requests_*), every ENGINE_PROBE_S."""

    caps: dict[str, int]  # port -> the router's max_concurrency for it (the engine's seats)
    max_running: dict[str, int] = field(default_factory=dict)
    max_sent: dict[str, int] = field(default_factory=dict)  # running + waiting: what it was sent and holds
    looks: int = 0
    timeline: list[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=list)  # (real s, port -> (running, waiting))


@dataclass
class SetupResult:
    setup: str
    description: str
    load: float
    capacity_req_s: float  # this set-up's modelled capacity for the mix, GPU time
    wall_s: float
    arrivals: int
    client_lag_p99_ms: float
    cores: dict[str, float]
    router_rss_mib: dict[str, float]  # start / warm-up end / window end / end / max, and the window's slope per minute
    classes: list[ClassStats]
    router_cores_max: float = math.nan  # the router's busiest PROBE_S interval
    access_lines_joined: float = math.nan  # share of the measured requests found in the access log
    timeline: list[Probe] = field(default_factory=list)
    kind: str = ""
    split: str = ""
    engine_count: int = 0
    load_average: list[float] = field(default_factory=list)  # os.getloadavg() as the set-up started
    concurrent: int = 1  # set-ups running at the same time as this one, itself included
    engines: EngineWatch | None = None
    moves: list[tuple[float, str]] = field(default_factory=list)  # (real s, the router's rebalancing log line)
    borrowed: dict[str, float] = field(default_factory=dict)  # requests seated on a lender's seat, "pool<-lender"
    outcomes_all: dict[str, dict[str, int]] = field(default_factory=dict)  # every request's outcome, warm-up included
    failures: dict[str, int] = field(default_factory=dict)  # what each failure was ("short other: 200, 12 tokens"), warm-up included
    series: list[dict[str, object]] = field(default_factory=list)  # per bin and class (``--bins``)
    round: int = 0  # which round of set-ups run at once it was in


@dataclass
class Result:
    command: list[str]
    engines: int
    split: str
    time_scale: float
    times_are: str
    traffic: str
    shared_capacity_req_s: float
    split_capacity_vs_shared: dict[str, float]
    mix: dict[str, list[tuple[float, int, int]]]
    warmup_s: float
    window_s: float
    drain_s: float
    seed: int
    short_deadline_s: float
    cpu_count: int
    fail_fast_fraction: float | None = None
    load_average: dict[str, list[float]] = field(default_factory=dict)  # os.getloadavg() at the start and the end
    mix_name: str = "origin"
    seats: int | None = None
    lend_rules: list[str] = field(default_factory=list)
    rebalance: dict[str, float] = field(default_factory=dict)  # GPU s
    max_engines: int = 0
    phase_s: float = 0.0  # shift: real s per phase
    notes: list[str] = field(default_factory=list)
    runs: list[SetupResult] = field(default_factory=list)
    checks: list[dict[str, object]] = field(default_factory=list)


# -- set-ups -------------------------------------------------------------------------


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
        pool = PoolSpec("all", everything.endpoints, everything.max_concurrency, everything.max_queue, [f"class_max_concurrency = {{ batch = {limit * n} }}"])
        return Setup(
            f"{name} [batch<={limit * n}]", f"priority's pool; batch holds at most {limit * n} of its {cap * n} seats",
            pools=[pool], class_pool={"interactive": "all", "batch": "all"}, kind=kind, engines=throughput,
        )
    if kind == "vllm-priority":
        # Twice the engine's seats per endpoint: what waits inside vLLM is what its priority scheduler orders
        # (V1 never preempts for a waiter; docs/vllm-priority.md), so at cap = seats the flag would change nothing.
        pool = PoolSpec("all", [(p, 2 * cap) for p in ports], 2 * cap * n, 512 * n, ["vllm_priority = true"])
        return Setup(
            name, f"priority's pool at {2 * cap} a engine (twice its seats), class priority sent to vLLM's priority scheduler "
            "(engines --scheduling-policy priority)",
            pools=[pool], class_pool={"interactive": "all", "batch": "all"}, kind=kind, engines=throughput, scheduling="priority",
        )
    assert split is not None
    interactive, batch = split
    latency_ports, batch_ports = ports[:interactive], ports[interactive:]
    engines = [(p, "latency") for p in latency_ports] + [(p, "throughput") for p in batch_ports]
    if kind == "split-direct":
        return Setup(
            name,
            f"disaggregated's split with no router: short round robin to {interactive} latency engine(s), "
            f"long to {batch} throughput engine(s), tailguard's forwarded bodies",
            by_kind={"short": latency_ports, "long": batch_ports}, kind=kind, engines=engines, split=split,
        )
    pools = [
        PoolSpec("interactive", [(p, seats["latency"]) for p in latency_ports], seats["latency"] * interactive, 256 * interactive),
        PoolSpec("batch", [(p, seats["throughput"]) for p in batch_ports], seats["throughput"] * batch, 512 * batch),
    ]
    tables: list[str] = []
    what = f"tailguard, interactive pool {interactive} latency engine(s), batch pool {batch} throughput engine(s)"
    if kind in ("lend", "lend-rebalance"):
        assert rule is not None
        tables += rule.toml("interactive", "batch")
        what += f"; interactive lends to batch ({rule.label()})"
        if options.lend_back:
            tables += LendRule().toml("batch", "interactive")
            what += ", batch lends to interactive"
    if kind in ("rebalance", "lend-rebalance"):
        tables += options.rebalance.toml(options.time_scale)
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
    lines = [
        *server_table(http_port, grpc_port),
        "[timeouts]",
        f"end_to_end_timeout = {END_TO_END_TIMEOUT * time_scale:g}",
        "",
    ]
    for pool in setup.pools:
        table = pool.toml()
        if fail_fast_fraction is not None:
            table.insert(-1, f"fail_fast_fraction = {fail_fast_fraction:g}")
        if setup.movable:
            table = [line.replace(" }", ", movable = true }") if line.startswith("endpoints = ") else line for line in table]
        lines += table
    lines += setup.tables
    relay = {"batch": batch_relay_interval * time_scale} if batch_relay_interval else None
    lines += classes_tables(setup.class_pool, {name: f"{QUEUE_TIMEOUTS[name] * time_scale:g}" for name in ("interactive", "batch")}, relay)
    return "\n".join(lines)


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
    latency = engine_params(options, "latency") if options else PROFILES["latency"]
    throughput = engine_params(options, "throughput") if options else PROFILES["throughput"]
    if split[0] == 0 or split[1] == 0:
        return math.nan
    interactive = pooled_capacity(split[0], latency, mix.get("short", []))
    return min(interactive, pooled_capacity(split[1], throughput, mix.get("long", [])))


# -- the run ---------------------------------------------------------------------------


async def measure(options: Options, command: list[str]) -> Result:
    """Start the simulators, then play every load against every set-up (several at once under --max-engines)."""
    interactive, batch = options.split
    schedules, mix, caps = _schedules(options)
    result = Result(
        command=command,
        engines=options.engines,
        split=", ".join(f"{i}:{b}" for i, b in (options.splits or [options.split])),
        time_scale=options.time_scale,
        times_are="GPU time: real divided by time_scale",
        traffic=str(options.trace) if options.trace else options.traffic,
        shared_capacity_req_s=caps["shared"],
        split_capacity_vs_shared={
            f"{i}:{options.engines - i}": split_capacity((i, options.engines - i), mix, options) / caps["shared"]
            for i in range(1, options.engines)
        },
        mix=mix,
        warmup_s=options.warmup,
        window_s=options.seconds,
        drain_s=options.drain,
        seed=options.seed,
        short_deadline_s=SHORT_DEADLINE_S,
        cpu_count=len(os.sched_getaffinity(0)),
        fail_fast_fraction=options.fail_fast_fraction,
        load_average={"start": [round(x, 2) for x in os.getloadavg()]},
        mix_name="trace" if options.trace else options.mix,
        seats=options.seats,
        lend_rules=[rule.label() for rule in options.lend_rules],
        rebalance=asdict(options.rebalance),
        max_engines=options.max_engines,
        phase_s=options.phase_seconds,
    )
    _announce(result, caps, schedules)
    setups = build_setups(options, _baseline_copies(options))
    if any(s.scheduling == "priority" for s in setups) and not _sim_knows_priority():
        note = "the simulator has no --scheduling-policy yet: vllm-priority was not run"
        result.notes.append(note)
        print(note, file=sys.stderr)
        setups = [s for s in setups if s.scheduling != "priority"]
    if options.baselines_each_round and options.max_engines > 0:
        rounds = _rounds_with_baselines(schedules, setups, options.max_engines)
        result.notes.append("every round ran its own shared and short-only: each set-up is compared with the baselines that ran beside it")
    else:
        rounds = _rounds([(load, arrivals, setup) for load, arrivals in schedules for setup in setups if "#" not in setup.name], options.max_engines)
    jobs = [job for group in rounds for job in group]
    with tempfile.TemporaryDirectory(prefix="tailguard-tail-") as tmp:
        logs = {policy: Path(tmp) / f"sim-{policy}.log" for policy in dict.fromkeys(s.scheduling for s in setups)}
        try:
            async with trio.open_nursery() as nursery:
                sims: dict[str, trio.Process] = {}
                for policy, log_path in logs.items():
                    engines = [e for s in setups if s.scheduling == policy for e in s.engines]
                    with log_path.open("wb") as sim_out:  # the child keeps its own descriptor
                        sims[policy] = await _start_simulator(nursery, engines, options, policy, sim_out)
                    for port, _ in engines:
                        await wait_ready(port, sims[policy], "the simulator")
                for number, group in enumerate(rounds, 1):
                    if len(rounds) > 1:
                        names = ", ".join(f"{s.name}@{load:g}" for load, _, s in group)
                        print(f"round {number}/{len(rounds)}: {names}", file=sys.stderr, flush=True)
                    found: dict[int, SetupResult] = {}

                    async def one(index: int, load: float, arrivals: list[Arrival], setup: Setup, size: int) -> None:
                        capacity = setup_capacity(setup, options, mix, caps)
                        found[index] = await _run_setup(setup, load, capacity, arrivals, options, sims[setup.scheduling], Path(tmp), size)

                    async with trio.open_nursery() as round_nursery:
                        for index, (load, arrivals, setup) in enumerate(group):
                            round_nursery.start_soon(one, index, load, arrivals, setup, len(group))
                    for i in range(len(group)):
                        found[i].round = number
                        result.runs.append(found[i])
                    for policy, sim in sims.items():
                        if sim.returncode is not None:
                            raise RuntimeError(f"the simulator ({policy}) exited with {sim.returncode}")
                nursery.cancel_scope.cancel()
        except Exception:
            for path in [*logs.values(), *Path(tmp).glob("tailguard-*.log")]:
                print(f"--- {path.name} ---\n{log_tail(path)}", file=sys.stderr)
            raise
    order = {(load, s.name): i for i, (load, _, s) in enumerate(jobs)}
    result.runs.sort(key=lambda r: order.get((r.load, r.setup), 0))
    result.load_average["end"] = [round(x, 2) for x in os.getloadavg()]
    result.checks = checks(result) + checks12(result, options)
    return result


def _baseline_copies(options: Options) -> int:
    """How many more copies of the baselines ``_rounds_with_baselines`` will need (rounds per load, less one)."""
    if not (options.baselines_each_round and options.max_engines > 0):
        return 0
    base = sum(1 for kind in BASELINES if kind in options.setups)
    per_round = max(1, options.max_engines // options.engines - base)
    rest = len(build_plans(options)) - base
    return max(0, math.ceil(rest / per_round) - 1)


def _rounds_with_baselines(
    schedules: Sequence[tuple[float, list[Arrival]]], setups: Sequence[Setup], budget: int
) -> list[list[tuple[float, list[Arrival], Setup]]]:
    """Per load, the other set-ups in rounds that each carry a copy of the baselines (the i-th round of a load the i-th copy)."""
    copies: dict[int, list[Setup]] = {}
    for setup in setups:
        if setup.kind in BASELINES:
            number = int(setup.name.rsplit("#", 1)[1]) if "#" in setup.name else 1
            copies.setdefault(number, []).append(setup)
    rest = [s for s in setups if s.kind not in BASELINES]
    room = budget - sum(len(s.engines) for s in copies.get(1, []))
    rounds: list[list[tuple[float, list[Arrival], Setup]]] = []
    for load, arrivals in schedules:
        groups: list[list[Setup]] = [[]]
        used = 0
        for setup in rest:
            if groups[-1] and used + len(setup.engines) > room:
                groups.append([])
                used = 0
            groups[-1].append(setup)
            used += len(setup.engines)
        for number, group in enumerate(groups, 1):
            rounds.append([(load, arrivals, s) for s in [*copies.get(number, []), *group]])
    return rounds


def _rounds(jobs: Sequence[tuple[float, list[Arrival], Setup]], budget: int) -> list[list[tuple[float, list[Arrival], Setup]]]:
    """Jobs in order, packed into rounds whose engines add up to at most ``budget`` (0: one job a round)."""
    rounds: list[list[tuple[float, list[Arrival], Setup]]] = []
    used = 0
    for job in jobs:
        size = len(job[2].engines)
        if not rounds or budget <= 0 or used + size > budget:
            rounds.append([])
            used = 0
        rounds[-1].append(job)
        used += size
    return rounds


def _sim_knows_priority() -> bool:
    """Whether ``python -m tailguard.sim`` takes ``--scheduling-policy`` (another change adds it)."""
    helped = subprocess.run([sys.executable, "-m", "tailguard.sim", "--help"], capture_output=True, text=True, check=False)
    return "--scheduling-policy" in helped.stdout


async def _start_simulator(
    nursery: trio.Nursery, engines: Sequence[tuple[int, str]], options: Options, policy: str, log: IO[bytes]
) -> trio.Process:
    """``python -m tailguard.sim`` serving ``engines``, with ``--seats`` and the scheduling policy applied to each."""
    spec = ",".join(f"{port}:{profile}" for port, profile in engines)
    command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--time-scale", f"{options.time_scale:g}"]
    if options.seats:
        command += ["--max-num-seqs", str(options.seats)]
    if policy != "fcfs":
        command += ["--scheduling-policy", policy]
    return await start_process(nursery, command, log)


def _schedules(options: Options) -> tuple[list[tuple[float, list[Arrival]]], dict[str, list[tuple[float, int, int]]], dict[str, float]]:
    """(load, arrivals) for each load, the mix, and the set-ups' capacities; a trace is one schedule at its own load."""
    if options.trace:
        arrivals = read_trace(options.trace, options.time_scale, options.warmup, options.seconds)
        if len(arrivals) < 2:
            raise ValueError(f"{options.trace}: fewer than two arrivals within warm-up + window")
        mix = mix_of(arrivals)
        caps = capacities(options, mix)
        rate = (len(arrivals) - 1) / ((arrivals[-1].at - arrivals[0].at) / options.time_scale)
        return [(rate / caps["shared"], arrivals)], mix, caps
    period = options.burst_period if options.traffic == "bursty" else None
    if options.mix == "shift":
        return _shift_schedules(options)
    shapes = MIXES[options.mix]()
    mix = shapes_by_class(shapes)
    caps = capacities(options, mix)
    schedules = [
        (load, generated(load * caps["shared"] / options.time_scale, options.warmup, options.seconds, options.seed, period, shapes))
        for load in options.loads
    ]
    if options.record_trace:
        write_trace(options.record_trace, schedules[0][1], options.time_scale)
        print(f"recorded the first load's schedule to {options.record_trace}", file=sys.stderr)
    return schedules, mix, caps


SHIFT_PHASES = ("chat", "origin")  # short-heavy first, then long-heavy


def _shift_schedules(options: Options) -> tuple[list[tuple[float, list[Arrival]]], dict[str, list[tuple[float, int, int]]], dict[str, float]]:
    """The shifting mix: each phase at ``load`` of the shared set-up's capacity for that phase's own mix."""
    schedules = []
    for load in options.loads:
        phases: list[tuple[float, float, Sequence[Shape]]] = []
        for name in SHIFT_PHASES:
            shapes = MIXES[name]()
            shared = pooled_capacity(options.engines, engine_params(options, "throughput"), [s[1:] for s in shapes])
            phases.append((options.phase_seconds, load * shared / options.time_scale, shapes))
        schedules.append((load, phased(phases, options.warmup, options.seed)))
    mix = mix_of(schedules[0][1])
    caps = capacities(options, mix)
    if options.record_trace:
        write_trace(options.record_trace, schedules[0][1], options.time_scale)
    return schedules, mix, caps


def _announce(result: Result, caps: dict[str, float], schedules: Sequence[tuple[float, list[Arrival]]]) -> None:
    splits = ", ".join(f"{k} {v:.2f}" for k, v in result.split_capacity_vs_shared.items())
    print(
        f"modelled capacity (GPU req/s): shared/priority {caps['shared']:.1f}, disaggregated {result.split} "
        f"{caps['disaggregated']:.1f}; split capacity vs shared: {splits}; time scale {result.time_scale:g}; "
        f"{', '.join(str(len(a)) for _, a in schedules)} arrivals per set-up",
        file=sys.stderr,
        flush=True,
    )


async def _run_setup(
    setup: Setup, load: float, capacity: float, arrivals: list[Arrival], options: Options, sim: trio.Process, tmp: Path, concurrent: int = 1
) -> SetupResult:
    """One set-up at one load: start its router (if any), play the schedule, stop it."""
    played = [a for a in arrivals if not (setup.drop_long and a.kind == "long")]
    timeline: list[Probe] = []
    load_average = [round(x, 2) for x in os.getloadavg()]
    engine_watch = EngineWatch(caps={str(port): _engine_cap(setup, port, options) for port, _ in setup.engines})
    async with _router(setup, options, tmp, load) as router:
        if setup.by_kind:
            by_kind = {k: [TokenPool(p) for p in setup.by_kind[k]] for k in CLASSES}
        else:
            everyone = [TokenPool(p) for p in ([router.port] if router else setup.direct)]
            by_kind = {k: everyone for k in CLASSES}  # one list: one round robin over both classes
        pools = list({id(pool): pool for group in by_kind.values() for pool in group}.values())
        make_body = forwarded_body if setup.by_kind else body_for
        cache: dict[tuple[int, int, int], bytes] = {}

        def request_of(p: int, a: Arrival) -> bytes:
            key = (p, a.prompt, a.max_tokens)
            if key not in cache:
                cache[key] = http_request(p, CHAT_PATH, make_body(a.prompt, a.max_tokens))
            return cache[key]

        pids = {"simulator": sim.pid} | ({"tailguard": router.process.pid} if router else {})
        try:
            async with trio.open_nursery() as nursery:
                origin, wall_origin = time.perf_counter(), time.time()
                if router:
                    nursery.start_soon(_watch, router, origin, timeline)
                nursery.start_soon(_watch_engines, engine_watch, origin, options.mix == "shift")
                before = CpuClock.read(pids)
                label = f"load {load:.2f} {setup.name}"
                samples, wall = await play(by_kind, request_of, played, options.drain, label, progress=concurrent == 1)
                cores = CpuClock.read(pids).cores_since(before)
                nursery.cancel_scope.cancel()
        finally:
            for pool in pools:
                await pool.aclose()
    joined = _join_access_log(router, samples) if router else math.nan
    moves = _moves_in_log(router, wall_origin) if router else []
    if options.samples_dir:
        write_samples(options.samples_dir / f"{options.name}-{_slug(setup.name)}-load{load:g}.jsonl", samples)
    await trio.sleep(1.0)  # aborted sequences leave the engines before the next set-up
    window = _window(played, options)
    served = (options.warmup, options.warmup + window)
    deadline = {"short": SHORT_DEADLINE_S}
    lags = sorted(s.lag for s in samples)
    classes = [
        class_stats(k, samples, options.time_scale, window, deadline.get(k), QUEUE_TIMEOUTS[_CLASS_OF[k]], served) for k in CLASSES
    ]
    outcomes_all: dict[str, dict[str, int]] = {}
    failures: dict[str, int] = {}
    for s in samples:
        outcomes_all.setdefault(s.kind, {})
        outcomes_all[s.kind][s.outcome] = outcomes_all[s.kind].get(s.outcome, 0) + 1
        if s.outcome not in ("ok", "cut"):
            what = f"{s.kind} {s.outcome}: " + ("no reply" if s.status is None else f"{s.status} {s.code or ''}".strip())
            what += f", {s.tokens} tokens" if s.status == 200 else ""
            failures[what] = failures.get(what, 0) + 1
    bins = options.bin_seconds or (2.0 if options.mix == "shift" else 0.0)
    return SetupResult(
        setup=setup.name,
        description=setup.description,
        load=load,
        capacity_req_s=capacity,
        wall_s=wall,
        arrivals=len(samples),
        client_lag_p99_ms=percentile(lags, 99) * 1000,
        cores=cores,
        router_rss_mib=_rss_summary(timeline, options),
        classes=classes,
        router_cores_max=max((p.cores for p in timeline), default=math.nan),
        access_lines_joined=joined,
        timeline=timeline,
        kind=setup.kind,
        split="" if setup.split is None else f"{setup.split[0]}:{setup.split[1]}",
        engine_count=len(setup.engines),
        load_average=load_average,
        concurrent=concurrent,
        engines=engine_watch,
        moves=moves,
        borrowed=_lent_max(timeline),
        outcomes_all=outcomes_all,
        failures=failures,
        series=_series(samples, bins, options.time_scale) if bins else [],
    )


def _slug(name: str) -> str:
    """A set-up's name as a file-name piece."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


def _engine_cap(setup: Setup, port: int, options: Options) -> int:
    """The most requests ``port`` should hold at once: its endpoint's max_concurrency, or its seats (no router)."""
    for pool in setup.pools:
        for p, cap in pool.endpoints:
            if p == port:
                return cap
    profile = dict(setup.engines)[port]
    return engine_params(options, profile).max_num_seqs


def _lent_max(timeline: Sequence[Probe]) -> dict[str, float]:
    """The most seats lent at once (the router's gauge, every PROBE_S) and the requests seated by a lender over the run."""
    if not timeline:
        return {}
    borrowed = [p.borrowed for p in timeline if not math.isnan(p.borrowed)]
    return {"lent_max": max(p.lent for p in timeline), "borrowed": borrowed[-1] - borrowed[0] if borrowed else math.nan}


def _moves_in_log(router: _Router, wall_origin: float) -> list[tuple[float, str]]:
    """The router's rebalancing lines for this run: (real s after the start, message)."""
    def pick(row: dict[str, Any]) -> tuple[float, str]:
        stamp = datetime.fromisoformat(str(row["ts"]).replace("Z", "+00:00")).timestamp()
        return round(stamp - wall_origin, 2), str(row.get("msg", ""))

    return list(router.log_rows(b"rebalancing:", pick))


def _series(samples: Sequence[Sample], bin_gpu_s: float, scale: float) -> list[dict[str, object]]:
    """Per bin of ``bin_gpu_s`` GPU s and class: arrivals, failures, E2E/TTFT P99 (by arrival), tokens/s served (by token time)."""
    width = bin_gpu_s * scale
    end = max((s.at for s in samples), default=0.0)
    tokens: dict[tuple[str, int], int] = {}
    for s in samples:
        if s.outcome in ("ok", "cut"):
            for t in token_times(s):
                key = (s.kind, int(t // width))
                tokens[key] = tokens.get(key, 0) + 1
    rows: list[dict[str, object]] = []
    for index in range(int(end // width) + 1):
        for kind in CLASSES:
            mine = [s for s in samples if s.kind == kind and index * width <= s.at < (index + 1) * width]
            ok = [s for s in mine if s.outcome == "ok"]
            e2e = sorted(s.e2e / scale * 1000 for s in ok if s.e2e is not None)
            ttft = sorted(s.ttft / scale * 1000 for s in ok if s.ttft is not None)
            rows.append({
                "t_gpu_s": round(index * bin_gpu_s, 3),
                "kind": kind,
                "n": len(mine),
                "not_ok": len(mine) - len(ok),
                "e2e_p99_ms": percentile(e2e, 99) if e2e else math.nan,
                "ttft_p99_ms": percentile(ttft, 99) if ttft else math.nan,
                "served_tok_s": tokens.get((kind, index), 0) / bin_gpu_s,
            })
    return rows


def forwarded_body(prompt: int, max_tokens: int) -> dict[str, object]:
    """The body tailguard sends an engine for this request (``Router._backend_body``), so ``split-direct`` sends the same.

    The client's body plus the pool's model, with max_tokens after the output
    cap of the limits every generated config leaves at their defaults.
    """
    body = body_for(prompt, max_tokens)
    capped, _ = effective_max_tokens(max_tokens, LimitsConfig())
    return {"model": MODEL, "messages": body["messages"], "max_tokens": capped, "stream": body["stream"]}


def _window(arrivals: Sequence[Arrival], options: Options) -> float:
    """Real seconds the measured arrivals span (the window, or less for a short trace)."""
    measured = [a.at for a in arrivals if a.measured]
    return min(options.seconds, measured[-1] - options.warmup) if measured else 0.0


@dataclass(frozen=True)
class _Router:
    """A running tailguard and where its log for this set-up begins."""

    port: int
    process: trio.Process
    log: Path
    log_from: int

    def log_rows(self, marker: bytes, pick: Callable[[dict[str, Any]], T]) -> Iterator[T]:
        """``pick(row)`` for each JSON line of this set-up's log holding ``marker``; a line that does not parse, or lacks what ``pick`` reads, is skipped."""
        with self.log.open("rb") as log:
            log.seek(self.log_from)
            for line in log:
                if marker not in line:
                    continue
                try:
                    picked = pick(json.loads(line))
                except (ValueError, KeyError, TypeError):
                    continue
                yield picked


@asynccontextmanager
async def _router(setup: Setup, options: Options, tmp: Path, load: float = math.nan) -> AsyncIterator[_Router | None]:
    """tailguard for ``setup`` in its own process (none for the direct set-ups); stopped on every path.

    It logs at the shipped level (INFO), so its access log times every request.
    """
    if not setup.pools:
        yield None
        return
    http_port, grpc_port = free_ports(2)
    config = tmp / f"{_slug(setup.name)}-{load:g}.toml"
    config.write_text(router_config(http_port, grpc_port, setup, options.time_scale, options.fail_fast_fraction, options.batch_relay_interval))
    log_path = tmp / f"tailguard-{_slug(setup.name)}-{load:g}.log"  # one each: set-ups may run at once
    with log_path.open("ab") as log:
        log_from = log.tell()
        async with trio.open_nursery() as nursery:
            process = await start_tailguard(nursery, config, log=log, extra_args=["--log-level", ROUTER_LOG_LEVEL])
            try:
                await wait_ready(http_port, process, "tailguard")
                yield _Router(http_port, process, log_path, log_from)
                if process.returncode is not None:
                    raise RuntimeError(f"tailguard exited with {process.returncode} during the run")
            finally:
                with trio.CancelScope(shield=True):
                    await stop(process)
                nursery.cancel_scope.cancel()


# -- watching the router -------------------------------------------------------------


async def _watch(router: _Router, origin: float, into: list[Probe]) -> None:
    """Every PROBE_S: the router's memory, CPU, open descriptors and queue (from /metrics)."""
    pid = router.process.pid
    client = TokenClient(router.port)
    scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{router.port}\r\n\r\n".encode()
    health = f"GET /health HTTP/1.1\r\nHost: {HOST}:{router.port}\r\n\r\n".encode()
    last_cpu, last_wait, last_t = sum(process_cpu_seconds(pid)), _runqueue_seconds(pid), time.perf_counter()
    try:
        while True:
            try:
                rss, peak = _memory_mib(pid)
                cpu, fds = sum(process_cpu_seconds(pid)), len(os.listdir(f"/proc/{pid}/fd"))
                wait = _runqueue_seconds(pid)
            except OSError:
                return
            now = time.perf_counter()
            health_ms = await _answer_ms(client, health)
            waiting, in_flight, gc_pauses, sharing = await _queue_gauges(client, scrape)
            cores, cpu_wait = (cpu - last_cpu) / (now - last_t), (wait - last_wait) / (now - last_t)
            into.append(
                Probe(
                    round(now - origin, 2), rss, peak, cores, cpu_wait, fds, waiting, in_flight, health_ms, gc_pauses,
                    assignment=sharing.assignment if sharing else None,
                    moving=sharing.moving if sharing else 0,
                    lent=sharing.lent if sharing else 0.0,
                    borrowed=sharing.borrowed if sharing else math.nan,
                )
            )
            last_cpu, last_wait, last_t = cpu, wait, now
            await trio.sleep(PROBE_S)
    finally:
        await client.aclose()


def _runqueue_seconds(pid: int) -> float:
    """Seconds the process's main thread (tailguard's event loop) has spent runnable but waiting for a CPU.

    From /proc/PID/schedstat (run time, run-queue wait, time slices; ns): on a
    shared machine this is how much of the router's latency is someone else's CPU.
    """
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


async def _answer_ms(client: TokenClient, request: bytes) -> float | None:
    """Milliseconds the router takes to answer ``request`` on a warm connection; None past 1 s or on error."""
    start = time.perf_counter()
    with trio.move_on_after(1.0):
        try:
            await client.exchange(request)
        except (OSError, trio.BrokenResourceError, ProtocolError):
            return None
        return (time.perf_counter() - start) * 1000
    return None


_GAUGES = {
    "waiting": b"tailguard_pool_queue_length{",
    "in_flight": b"tailguard_pool_in_flight{",
    "gc_count": b"tailguard_gc_pause_seconds_count{",
    "gc_fast": b'tailguard_gc_pause_seconds_bucket{generation="',  # only the le="0.01" buckets, below
    "gc_seconds": b"tailguard_gc_pause_seconds_sum{",
    "moving": b"tailguard_endpoint_moving{",
    "lent": b"tailguard_pool_lent_seats{",
    "borrowed": b"tailguard_pool_borrowed_total{",
}


@dataclass(frozen=True)
class _Sharing:
    """Lending and rebalancing as the router's /metrics tells them."""

    assignment: dict[str, int]  # pool -> endpoints now
    moving: int
    lent: float
    borrowed: float


_ASSIGNED = re.compile(rb'^tailguard_endpoint_assignment\{[^}]*pool="([^"]*)"')


async def _queue_gauges(
    client: TokenClient, scrape: bytes
) -> tuple[float | None, float | None, tuple[float, float, float] | None, _Sharing | None]:
    """Requests waiting and holding a seat, summed over pools, the GC pauses so far, and the sharing, from the router's /metrics."""
    with trio.move_on_after(1.0):
        try:
            reply = await client.exchange(scrape)
        except (OSError, trio.BrokenResourceError, ProtocolError):
            return None, None, None, None
        if reply.status != 200:
            return None, None, None, None
        sums = dict.fromkeys(_GAUGES, 0.0)
        assignment: dict[str, int] = {}
        for line in client.last_piece.splitlines():
            for name, prefix in _GAUGES.items():
                if line.startswith(prefix) and (name != "gc_fast" or b'le="0.01"' in line):
                    sums[name] += float(line.rsplit(b" ", 1)[1])
            if match := _ASSIGNED.match(line):
                pool = match.group(1).decode()
                assignment[pool] = assignment.get(pool, 0) + 1
        gc_pauses = (sums["gc_count"], sums["gc_count"] - sums["gc_fast"], sums["gc_seconds"])
        sharing = _Sharing(assignment, int(sums["moving"]), sums["lent"], sums["borrowed"])
        return sums["waiting"], sums["in_flight"], gc_pauses, sharing
    return None, None, None, None


async def _watch_engines(watch: EngineWatch, origin: float, keep: bool) -> None:
    """Every ENGINE_PROBE_S: each engine's own running and waiting counts; the most seen; all of them if ``keep``."""
    clients = {port: TokenClient(int(port)) for port in watch.caps}
    try:
        while True:
            look: dict[str, tuple[int, int]] = {}
            for port, client in clients.items():
                scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
                with trio.move_on_after(1.0):
                    try:
                        if (await client.exchange(scrape)).status == 200:
                            look[port] = engine_counts(client.last_piece)
                    except (OSError, trio.BrokenResourceError, ProtocolError):
                        pass
            for port, (running, waiting) in look.items():
                watch.max_running[port] = max(watch.max_running.get(port, 0), running)
                watch.max_sent[port] = max(watch.max_sent.get(port, 0), running + waiting)
            watch.looks += 1
            if keep:
                watch.timeline.append((round(time.perf_counter() - origin, 2), look))
            await trio.sleep(ENGINE_PROBE_S)
    finally:
        for client in clients.values():
            await client.aclose()


def _join_access_log(router: _Router, samples: Sequence[Sample]) -> float:
    """Put the router's own end-to-end time and TTFT (its access log) on each sample; the share of measured ones found."""
    times = dict(router.log_rows(b'"tailguard.access"', lambda row: (str(row["request_id"]), (_seconds(row["e2e_ms"]), _seconds(row["ttft_ms"])))))
    measured = [s for s in samples if s.measured]
    for s in samples:
        s.router_e2e, s.router_ttft = times.get(s.request_id, (None, None))
    return sum(1 for s in measured if s.router_e2e is not None) / len(measured) if measured else math.nan


def _seconds(ms: float | None) -> float | None:
    """An access log's milliseconds (null when not measured) as seconds."""
    return None if ms is None else float(ms) / 1000


def _rss_summary(timeline: Sequence[Probe], options: Options) -> dict[str, float]:
    """RSS at the start, at the end of the warm-up, at the last arrival, at the end; the peak; the window's slope."""
    if not timeline:
        return {}

    def at(t: float) -> float:
        return min(timeline, key=lambda p: abs(p.t - t)).rss_mib

    window = [p for p in timeline if options.warmup <= p.t <= options.warmup + options.seconds]
    return {
        "start": timeline[0].rss_mib,
        "warmup_end": at(options.warmup),
        "window_end": at(options.warmup + options.seconds),
        "end": timeline[-1].rss_mib,
        "max": timeline[-1].peak_rss_mib,
        "window_slope_per_min": _slope([p.t for p in window], [p.rss_mib for p in window]) * 60,
    }


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (NaN with fewer than 3 points)."""
    if len(xs) < 3:
        return math.nan
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else math.nan


# -- the targets -------------------------------------------------------------------------


def checks(result: Result) -> list[dict[str, object]]:
    """The issue's targets, reported (not tuned for), at the loads nearest 0.8 and the top load."""
    by = {(r.setup, round(r.load, 2)): r for r in result.runs}
    loads = sorted({round(r.load, 2) for r in result.runs if not math.isnan(r.load)})
    found: list[dict[str, object]] = []

    def stat(setup: str, load: float, kind: str) -> ClassStats | None:
        run = by.get((setup, load))
        return next((c for c in run.classes if c.kind == kind), None) if run else None

    def add(name: str, value: float | str, target: str, met: bool | None) -> None:
        found.append({"check": name, "value": value, "target": target, "met": met})

    if not loads:
        return found
    mid = min(loads, key=lambda x: abs(x - 0.8))
    dis, ideal, shared = stat("disaggregated", mid, "short"), stat("short-only", mid, "short"), stat("shared", mid, "short")
    if dis and ideal:
        ratio = dis.e2e_ms["p99"] / ideal.e2e_ms["p99"]
        add(f"load {mid:g}: disaggregated short E2E P99 / short-only", round(ratio, 2), "<= 1.25", ratio <= 1.25)
    if dis and shared:
        ratio = shared.e2e_ms["p99"] / dis.e2e_ms["p99"]
        add(f"load {mid:g}: shared short E2E P99 / disaggregated", round(ratio, 2), ">= 5 (if shared inflated)", ratio >= 5)
    long_dis, long_shared = stat("disaggregated", mid, "long"), stat("shared", mid, "long")
    if long_dis and long_shared and long_shared.goodput_tok_s:
        ratio = long_dis.goodput_tok_s / long_shared.goodput_tok_s
        add(f"load {mid:g}: disaggregated long goodput / shared", round(ratio, 2), ">= 0.9", ratio >= 0.9)
    for load in (x for x in loads if x < 0.9):
        for setup in ("priority", "disaggregated"):
            if c := stat(setup, load, "short"):
                failed = c.n - c.outcomes.get("ok", 0)
                add(f"load {load:g}: {setup} short failures", failed, "0", failed == 0)
    for load in loads:
        routed, direct = stat("disaggregated", load, "short"), stat("split-direct", load, "short")
        if routed and direct:
            found.append(_added_ttft_check(load, routed, direct, result.time_scale, judged=load == mid))
    top = max(loads)
    if top >= 1.2:
        for setup in ("priority", "disaggregated"):
            if run := by.get((setup, top)):
                found += _overload_checks(run, result.time_scale)
                found += _router_rejection_checks(run)
    return found


def _added_ttft_check(load: float, routed: ClassStats, direct: ClassStats, scale: float, judged: bool) -> dict[str, object]:
    """Short TTFT P99 through tailguard minus the same split fed directly, in real ms (the router's CPU is real time).

    The tables show GPU ms (real / time scale); the router's added latency is
    judged in real ms, as a caller of a real deployment would feel it.
    """
    routed_ms, direct_ms = routed.ttft_ms["p99"] * scale, direct.ttft_ms["p99"] * scale
    added = routed_ms - direct_ms
    value = f"{added:+.1f} real ms ({routed_ms:.1f} vs {direct_ms:.1f}; {added / scale:+.1f} GPU ms)"
    target = f"<= +{ADDED_TTFT_GOAL_MS:g} real ms" if judged else "- (judged at load 0.8)"
    met = (not math.isnan(added) and added <= ADDED_TTFT_GOAL_MS) if judged else None
    return {"check": f"load {load:g}: disaggregated short TTFT P99 - split-direct", "value": value, "target": target, "met": met}


def _router_rejection_checks(run: SetupResult) -> list[dict[str, object]]:
    """Each kind of rejection's P99 as tailguard's access log timed it (real ms): refusals at arrival must be fast.

    A 503 queue_timeout that waited for a seat until its deadline is slow by
    design; it is reported, not judged.
    """
    found: list[dict[str, object]] = []
    for c in run.classes:
        for kind, r in c.rejections.items():
            p99 = r.router_ms["p99"]
            waited = kind.endswith("after waiting")
            target = "- (waited for its deadline)" if waited else f"<= {FAST_REJECTION_MS:g}"
            met = None if waited or math.isnan(p99) else p99 <= FAST_REJECTION_MS
            value: float | str = "- (no access-log line joined)" if math.isnan(p99) else round(p99, 1)
            found.append({"check": f"load {run.load:g}: {run.setup} {c.kind} {kind} router-side P99 real ms (n {r.n})", "value": value, "target": target, "met": met})
    return found


def _overload_checks(run: SetupResult, scale: float) -> list[dict[str, object]]:
    """Overload targets for one tailguard run: short requests on time, rejections fast, memory flat."""
    found: list[dict[str, object]] = []
    name = f"load {run.load:g}: {run.setup}"

    def add(check: str, value: float | str, target: str, met: bool | None) -> None:
        found.append({"check": f"{name} {check}", "value": value, "target": target, "met": met})

    short = next(c for c in run.classes if c.kind == "short")
    deadline_ms = SHORT_DEADLINE_S * 1000
    add("short E2E P99 ms (ok ones)", round(short.e2e_ms["p99"]), f"<= {deadline_ms:g}", short.e2e_ms["p99"] <= deadline_ms)
    on_time = short.ok_within_deadline or 0.0
    add("short ok ones within deadline", round(on_time, 3), ">= 0.99", on_time >= 0.99)
    add("short served (ok / all)", round(short.outcomes.get("ok", 0) / short.n, 3) if short.n else "-", "-", None)
    for c in run.classes:
        class_deadline_ms = QUEUE_TIMEOUTS[_CLASS_OF[c.kind]] * scale * 1000
        for kind, r in c.rejections.items():
            p99 = r.client_ms["p99"]
            if kind.startswith("429"):
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), f"< {FAST_REJECTION_MS:g}", p99 < FAST_REJECTION_MS)
            elif kind.startswith("503 queue_timeout"):
                bound = class_deadline_ms + 50
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), f"<= {bound:g} (deadline + 50)", p99 <= bound)
            else:
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), "-", None)
    slope = run.router_rss_mib.get("window_slope_per_min", math.nan)
    if not math.isnan(slope):
        add("router RSS growth in the window, MiB/min", round(slope, 2), "flat: <= 1", slope <= 1.0)
    return found


# -- issue 12's targets ------------------------------------------------------------------

GOALS_4 = (0.95, 1.25, 2.0)  # 4 engines: long served >= x shared; short E2E P99 <= x ideal; short TTFT P99 <= x ideal
GOALS_2 = (0.9, 1.45)  # 2 engines at 0.9: long >= x round robin; short E2E P99 <= x ideal
GOALS_1 = (0.9, 1.6)  # 1 engine: long >= x FIFO; short E2E P99 <= x ideal


@dataclass(frozen=True)
class Versus:
    """One run against its load's baselines: long served rate over shared's, short P99s over short-only's."""

    long: float
    short_e2e: float
    short_ttft: float
    short_p99_ms: float
    long_tok_s: float
    short_not_ok: int  # measured short requests that did not end ok
    long_failed: int  # measured long requests that ended in an error (not ok and not cut by the run's end)


def versus(result: Result) -> dict[tuple[str, float], Versus]:
    """Each run's ratios to the same load's ``shared`` (long) and ``short-only`` (short) runs."""
    found: dict[tuple[str, float], Versus] = {}
    by = {(r.kind, round(r.load, 2)): r for r in result.runs if r.kind in BASELINES and "#" not in r.setup}
    beside = {(r.kind, round(r.load, 2), r.round): r for r in result.runs if r.kind in BASELINES}
    for run in result.runs:
        load = round(run.load, 2)
        shared = beside.get(("shared", load, run.round)) or by.get(("shared", load))  # the one that ran beside it, if any
        ideal = beside.get(("short-only", load, run.round)) or by.get(("short-only", load))
        short, long = _kind(run, "short"), _kind(run, "long")
        if short is None:
            continue
        long_rate = long.served_tok_s if long else math.nan
        shared_long = _kind(shared, "long") if shared else None
        ideal_short = _kind(ideal, "short") if ideal else None
        long_failed = long.n - long.outcomes.get("ok", 0) - long.outcomes.get("cut", 0) if long else 0
        found[(run.setup, load)] = Versus(
            long=long_rate / shared_long.served_tok_s if shared_long and shared_long.served_tok_s else math.nan,
            short_e2e=short.e2e_ms["p99"] / ideal_short.e2e_ms["p99"] if ideal_short else math.nan,
            short_ttft=short.ttft_ms["p99"] / ideal_short.ttft_ms["p99"] if ideal_short else math.nan,
            short_p99_ms=short.e2e_ms["p99"],
            long_tok_s=long_rate,
            short_not_ok=short.n - short.outcomes.get("ok", 0),
            long_failed=long_failed,
        )
    return found


def _kind(run: SetupResult, kind: str) -> ClassStats | None:
    return next((c for c in run.classes if c.kind == kind and c.n), None)


def checks12(result: Result, options: Options) -> list[dict[str, object]]:
    """Issue 12's targets for this run's engine count (reported, not tuned for)."""
    found: list[dict[str, object]] = []
    table = versus(result)

    def add(name: str, value: str, target: str, met: bool | None) -> None:
        found.append({"check": name, "value": value, "target": target, "met": met})

    def describe(v: Versus) -> str:
        return f"long {v.long:.2f}, short E2E {v.short_e2e:.2f}x, TTFT {v.short_ttft:.2f}x"

    tailguard = [r for r in result.runs if r.kind in TAILGUARD_SPLIT_KINDS + ("priority", "shared-limit", "vllm-priority")]
    if not any(r.kind == "short-only" for r in result.runs) or not any(r.kind == "shared" for r in result.runs):
        return found
    for run in tailguard:
        v = table.get((run.setup, round(run.load, 2)))
        if v is None:
            continue
        name = f"load {run.load:g}: {run.setup}"
        if options.mix == "shift":
            continue
        if result.engines >= 3:
            long_goal, e2e_goal, ttft_goal = GOALS_4
            met = v.long >= long_goal and v.short_e2e <= e2e_goal and v.short_ttft <= ttft_goal
            add(name, describe(v), f"long >= {long_goal}, E2E <= {e2e_goal}x, TTFT <= {ttft_goal}x", met)
        elif result.engines == 2:
            long_goal, e2e_goal = GOALS_2
            judged = round(run.load, 2) >= 0.9
            met = v.long >= long_goal and v.short_e2e <= e2e_goal
            add(name, describe(v), f"long >= {long_goal} of RR, E2E <= {e2e_goal}x" + ("" if judged else " (judged at 0.9)"), met if judged else None)
        else:
            long_goal, e2e_goal = GOALS_1
            met = v.long >= long_goal and v.short_e2e <= e2e_goal
            add(name, describe(v), f"long >= {long_goal} of FIFO, E2E <= {e2e_goal}x", met)
    if result.engines == 2:
        found += _dominance(result, table)
    if options.mix == "shift":
        found += _shift_checks(result, table, options)
    for run in result.runs:
        if run.engines is None or not run.engines.looks or not run.timeline:
            continue  # no router: engines may queue, that is the point of the baseline
        over = [p for p, n in run.engines.max_sent.items() if n > run.engines.caps.get(p, n)]
        worst = max(run.engines.max_sent.values(), default=0)
        add(
            f"load {run.load:g}: {run.setup} engines' running + waiting, max over {run.engines.looks} looks",
            f"{worst} (caps {sorted(set(run.engines.caps.values()))})", "<= each endpoint's cap", not over,
        )
    return found


def _dominance(result: Result, table: dict[tuple[str, float], Versus]) -> list[dict[str, object]]:
    """2 engines: does each lending/rebalancing setting dominate round robin and every static split at its load?"""
    found: list[dict[str, object]] = []
    for load in sorted({round(r.load, 2) for r in result.runs}):
        others = [r for r in result.runs if round(r.load, 2) == load and r.kind in ("shared", "disaggregated")]
        for run in (r for r in result.runs if round(r.load, 2) == load and r.kind in ("lend", "rebalance", "lend-rebalance")):
            mine = table.get((run.setup, load))
            if mine is None:
                continue
            beaten = []
            for other in others:
                theirs = table.get((other.setup, load))
                if theirs is None:
                    continue
                at_least = mine.long_tok_s >= theirs.long_tok_s * 0.99 and mine.short_p99_ms <= theirs.short_p99_ms * 1.01
                better = mine.long_tok_s > theirs.long_tok_s * 1.01 or mine.short_p99_ms < theirs.short_p99_ms * 0.99
                if not (at_least and better):
                    beaten.append(other.setup)
            value = "dominates all" if not beaten else "not over " + ", ".join(beaten)
            found.append(
                {"check": f"load {load:g}: {run.setup} dominates {', '.join(o.setup for o in others)}", "value": value,
                 "target": "as good on both axes (1% slack), better on one", "met": not beaten}
            )
    return found


def _shift_checks(result: Result, table: dict[tuple[str, float], Versus], options: Options) -> list[dict[str, object]]:
    """The shifting mix: nothing dropped, short P99 within the 4-engine target, the assignment follows."""
    found: list[dict[str, object]] = []
    for run in result.runs:
        if run.kind not in TAILGUARD_SPLIT_KINDS:
            continue
        v = table.get((run.setup, round(run.load, 2)))
        dropped = sum(n for by in run.outcomes_all.values() for outcome, n in by.items() if outcome not in ("ok", "cut"))
        cut = sum(by.get("cut", 0) for by in run.outcomes_all.values())
        name = f"shift load {run.load:g}: {run.setup}"
        found.append(
            {"check": f"{name}: requests that failed (whole run; still running at the drain's end: {cut})", "value": str(dropped), "target": "0", "met": dropped == 0}
        )
        if v is not None:
            long_goal, e2e_goal, ttft_goal = GOALS_4
            met = v.short_e2e <= e2e_goal and v.short_ttft <= ttft_goal
            found.append(
                {"check": f"{name}: short P99 over the window vs short-only", "value": f"E2E {v.short_e2e:.2f}x, TTFT {v.short_ttft:.2f}x",
                 "target": f"E2E <= {e2e_goal}x, TTFT <= {ttft_goal}x", "met": met}
            )
        if run.kind in ("rebalance", "lend-rebalance"):
            shift_at = options.phase_seconds
            after = [(t, m) for t, m in run.moves if t >= shift_at and "leaves" in m]
            before = [(t, m) for t, m in run.moves if t < shift_at and "leaves" in m]
            first = f"{(after[0][0] - shift_at) / options.time_scale:.1f} GPU s after the shift" if after else "no move after the shift"
            value = f"{len(before)} move(s) in phase 1, {len(after)} in phase 2; first of phase 2 {first} (hold {options.rebalance.hold:g} GPU s)"
            found.append({"check": f"{name}: the assignment follows the mix", "value": value, "target": "a move each way", "met": bool(before and after)})
    return found


# -- reporting -------------------------------------------------------------------------


def render(result: Result) -> str:
    """The markdown report: per load, latency, rejection, process and memory tables; then the targets."""
    fail_fast = "router default" if result.fail_fast_fraction is None else f"{result.fail_fast_fraction:g}"
    out = [
        f"Engines {result.engines} (split {result.split} for disaggregated), traffic {result.traffic}, "
        f"time scale {result.time_scale:g} ({result.times_are}); shared capacity {result.shared_capacity_req_s:.1f} req/s; "
        f"warm-up {result.warmup_s:g} s, window {result.window_s:g} s, drain <= {result.drain_s:g} s (real) per set-up; "
        f"pools' fail_fast_fraction {fail_fast}; load average at start {result.load_average.get('start')}, "
        f"at end {result.load_average.get('end')} ({result.cpu_count} cores).",
        "",
        f"Command: `{' '.join(result.command)}`",
        "",
        f"Mix {result.mix_name}"
        + (f" ({result.phase_s:g} real s of each phase: chat, then origin)" if result.phase_s else "")
        + f"; engines' max_num_seqs {result.seats or 'profile default'}; lending rule(s) {', '.join(result.lend_rules)}; "
        f"rebalance (GPU s) {result.rebalance}; set-ups at once: engines <= {result.max_engines or 'one set-up at a time'}.",
        *[f"Note: {note}" for note in result.notes],
        "",
    ]
    table = versus(result)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        runs = [r for r in result.runs if round(r.load, 2) == load]
        out += [f"### load {load:g}", "", *_latency_table(runs), ""]
        if work := _work_table(runs, table, result.time_scale):
            out += [*work, ""]
        if added := _added_table(runs, result.time_scale):
            out += [*added, ""]
        out += [*_rejection_table(runs), "", *_process_table(runs, result), ""]
        if any(r.timeline for r in runs):
            out += [*_memory_table(runs), ""]
    checks = [(c["check"], c["value"], c["target"], "-" if c["met"] is None else "PASS" if c["met"] else "MISS") for c in result.checks]
    out += ["### targets (reported, not tuned for)", "", *md_table(["check", "value", "target", "met"], checks)]
    return "\n".join(out) + "\n"


STARVED_LAG_GPU_MS = 25.0  # the client sent its requests this late (P99): the machine's CPU, not the policy, is measured


def _work_table(runs: Sequence[SetupResult], table: dict[tuple[str, float], Versus], scale: float) -> list[str]:
    """Issue 12's view of one load: each set-up against shared (long served) and short-only (short P99s).

    A run whose client sent its requests more than STARVED_LAG_GPU_MS late
    (P99) is marked: a busy machine, not the set-up, made its latencies.
    """
    rows = [(run, table.get((run.setup, round(run.load, 2)))) for run in runs]
    if not any(v is not None and not math.isnan(v.long) for _, v in rows):
        return []
    header = [
        "set-up", "long served tok/s (x shared)", "short E2E P99 ms (x ideal)", "short TTFT P99 ms (x ideal)", "short not ok / long failed",
        "lent max / borrowed", "moves", "engines max running / sent (cap)", "load avg at start, set-ups at once, round", "client lag P99, GPU ms",
    ]
    cells = []
    for run, v in rows:
        if v is None:
            continue
        short = _kind(run, "short")
        assert short is not None
        lent = f"{run.borrowed.get('lent_max', math.nan):.0f} / {run.borrowed.get('borrowed', math.nan):.0f}" if run.borrowed else "-"
        moves = sum(1 for _, m in run.moves if "joined" in m)
        watch = run.engines
        engines = (
            f"{max(watch.max_running.values(), default=0)} / {max(watch.max_sent.values(), default=0)} ({max(watch.caps.values(), default=0)})"
            if watch and watch.looks else "-"
        )
        lag = run.client_lag_p99_ms / scale
        cells.append([
            run.setup, f"{v.long_tok_s:,.0f} ({v.long:.2f})", f"{short.e2e_ms['p99']:,.0f} ({v.short_e2e:.2f})",
            f"{short.ttft_ms['p99']:.1f} ({v.short_ttft:.2f})", f"{v.short_not_ok} / {v.long_failed}", lent, moves, engines,
            f"{run.load_average[0] if run.load_average else '-'}, {run.concurrent}, {run.round}",
            f"{lag:.0f}{' (starved)' if lag > STARVED_LAG_GPU_MS else ''}",
        ])
    return md_table(header, cells)


def _latency_table(runs: Sequence[SetupResult]) -> list[str]:
    header = [
        "set-up", "class", "n", "TTFT P50/P95/P99 ms", "E2E P50/P95/P99 ms", "ITL P50/P99 ms", "ok/429/503/timeout/other/cut",
        "ok ones within deadline", "goodput tok/s",
    ]
    return md_table(header, (_latency_row(run, c) for run in runs for c in run.classes if c.n))


def _latency_row(run: SetupResult, c: ClassStats) -> list[object]:
    outcome = "/".join(str(c.outcomes.get(k, 0)) for k in ("ok", "429", "503", "timeout", "other", "cut"))
    on_time = "-" if c.ok_within_deadline is None else f"{c.ok_within_deadline:.3f}"
    return [run.setup, c.kind, c.n, _trio(c.ttft_ms), _trio(c.e2e_ms), _trio(c.itl_ms), outcome, on_time, f"{c.goodput_tok_s:,.0f}"]


def _rejection_table(runs: Sequence[SetupResult]) -> list[str]:
    """How fast each kind of rejection came back: real ms at the client and inside the router, and GPU ms."""
    rows = [
        (run, c, kind, r) for run in runs for c in run.classes for kind, r in c.rejections.items()
    ]
    if not rows:
        return ["No request was rejected."]
    header = [
        "set-up", "class", "rejection", "n", "client real ms P50/P99/max", "router real ms P50/P99/max", "GPU ms P50/P99",
        f"share < {FAST_REJECTION_MS:g} ms real",
    ]
    return md_table(header, (
        (run.setup, c.kind, kind, r.n, _trio(r.client_ms), _trio(r.router_ms), _trio(r.gpu_ms), f"{r.under_10ms:.3f}")
        for run, c, kind, r in rows
    ))


def _process_table(runs: Sequence[SetupResult], result: Result) -> list[str]:
    header = [
        "set-up", "capacity req/s", "own load", "wall s", "cores sim/router/client", "router's busiest 2 s, cores",
        "router loop waiting for a CPU, mean / max share", "client lag P99 ms", "access log lines joined",
    ]
    rows = []
    for run in runs:
        cores = f"{run.cores['simulator']:.2f}/{run.cores.get('tailguard', 0):.2f}/{run.cores['client']:.2f}"
        own = run.load * result.shared_capacity_req_s / run.capacity_req_s
        busiest = "-" if math.isnan(run.router_cores_max) else f"{run.router_cores_max:.2f}"
        joined = "-" if math.isnan(run.access_lines_joined) else f"{run.access_lines_joined:.3f}"
        waits = [p.cpu_wait for p in run.timeline]
        starved = f"{sum(waits) / len(waits):.2f} / {max(waits):.2f}" if waits else "-"
        rows.append([
            run.setup, f"{run.capacity_req_s:.1f}", f"{own:.2f}", f"{run.wall_s:.0f}", cores, busiest, starved, f"{run.client_lag_p99_ms:.1f}", joined
        ])
    return md_table(header, rows)


def _memory_table(runs: Sequence[SetupResult]) -> list[str]:
    """The router's RSS over the run (so 'flat' can be judged) beside its sockets and queue."""
    header = [
        "set-up", "router RSS MiB start / warm-up end / last arrival / end", "peak", "window slope MiB/min", "open fds max", "waiting max",
        "GET /health ms P50 / max (None = over 1 s)", "GC pauses: n / over 10 ms / total ms", f"samples (every {PROBE_S:g} s)",
    ]
    rows = []
    for run in runs:
        if not run.timeline:
            continue
        rss = run.router_rss_mib
        points = " / ".join(f"{rss[k]:.0f}" for k in ("start", "warmup_end", "window_end", "end"))
        waiting = max((p.waiting for p in run.timeline if p.waiting is not None), default=math.nan)
        answered = sorted(p.health_ms for p in run.timeline if p.health_ms is not None)
        late = sum(1 for p in run.timeline if p.health_ms is None)
        health = f"{percentile(answered, 50):.1f} / {answered[-1] if answered else math.nan:.0f}" + (f" ({late} over 1 s)" if late else "")
        rows.append([
            run.setup, points, f"{rss['max']:.0f}", f"{rss['window_slope_per_min']:+.2f}", max(p.fds for p in run.timeline), f"{waiting:.0f}",
            health, _gc_during(run.timeline), len(run.timeline),
        ])
    return md_table(header, rows)


def _short(run: SetupResult) -> ClassStats:
    return next(c for c in run.classes if c.kind == "short")


def _added_table(runs: Sequence[SetupResult], scale: float) -> list[str]:
    """Short TTFT in real ms, through tailguard and fed directly: what the router adds (empty unless both ran)."""
    by = {r.setup: _short(r) for r in runs}
    if not {"disaggregated", "split-direct"} <= set(by):
        return []
    routed, direct = by["disaggregated"].ttft_ms, by["split-direct"].ttft_ms
    keys = ("p50", "p95", "p99")
    rows = [[name, *(f"{q[k] * scale:.1f}" for k in keys)] for name, q in (("disaggregated (tailguard)", routed), ("split-direct (no router)", direct))]
    rows.append(["added by tailguard", *(f"{(routed[k] - direct[k]) * scale:+.1f}" for k in keys)])
    return md_table(["short TTFT, real ms", "P50", "P95", "P99"], rows)


def _gc_during(timeline: Sequence[Probe]) -> str:
    """The router's GC pauses between the first and the last look ("-" when /metrics never told)."""
    seen = [p.gc for p in timeline if p.gc is not None]
    if len(seen) < 2:
        return "-"
    (n0, slow0, s0), (n1, slow1, s1) = seen[0], seen[-1]
    return f"{n1 - n0:.0f} / {slow1 - slow0:.0f} / {(s1 - s0) * 1000:.0f}"


def _trio(q: dict[str, float]) -> str:
    return " / ".join("-" if math.isnan(v) else f"{v:,.0f}" if v >= 100 else f"{v:.1f}" for v in q.values())


def write_outputs(result: Result, options: Options, table: str) -> list[Path]:
    """JSON, markdown and the plots; returns their paths."""
    paths = [options.out / f"{options.name}.json", options.out / f"{options.name}.md"]  # a name may hold dots
    payload = asdict(result)
    for run_json in payload["runs"]:
        for class_json in run_json["classes"]:
            class_json.pop("e2e_sorted_ms")
            class_json.pop("ttft_sorted_ms")
    write_json(paths[0], payload)
    paths[1].write_text(table)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        runs = [r for r in result.runs if round(r.load, 2) == load]
        curves = {r.setup: {c.kind: c.e2e_sorted_ms for c in r.classes} for r in runs}
        paths.append(options.out / f"{options.name}-cdf-load{load:g}.png")
        plot_cdfs(paths[-1], load, curves)
        if {"disaggregated", "split-direct"} <= set(curves):
            ttft = {r.setup: {"short": [v * result.time_scale for v in _short(r).ttft_sorted_ms]} for r in runs}
            paths.append(options.out / f"{options.name}-short-ttft-load{load:g}.png")
            plot_cdfs(paths[-1], load, ttft, "short TTFT, ms (real time)")
        timelines = {r.setup: [(p.t, p.rss_mib, p.waiting) for p in r.timeline] for r in runs if r.timeline}
        if timelines:
            paths.append(options.out / f"{options.name}-router-load{load:g}.png")
            plot_timelines(paths[-1], load, timelines, (options.warmup, options.warmup + options.seconds))
    series: dict[str, list[tuple[float, float]]] = {}
    for run in result.runs:
        series.setdefault(run.setup, []).append((run.load, _short(run).e2e_ms["p99"]))
    paths.append(options.out / f"{options.name}-short-p99-vs-load.png")
    plot_p99_vs_load(paths[-1], series, SHORT_DEADLINE_S * 1000)
    ratios = versus(result)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        points = {
            run.setup: (v.long, v.short_e2e)
            for run in result.runs
            if round(run.load, 2) == load and run.kind != "short-only" and (v := ratios.get((run.setup, load))) and not math.isnan(v.long)
        }
        if len(points) > 1:
            paths.append(options.out / f"{options.name}-tradeoff-load{load:g}.png")
            plot_tradeoff(paths[-1], load, points, result.engines)
    shifting = [r for r in result.runs if r.series]
    if shifting:
        for load in dict.fromkeys(round(r.load, 2) for r in shifting):
            runs = [r for r in shifting if round(r.load, 2) == load]
            paths.append(options.out / f"{options.name}-shift-load{load:g}.png")
            plot_shift(
                paths[-1],
                load,
                {r.setup: r.series for r in runs},
                {r.setup: [(p.t / result.time_scale, p.assignment) for p in r.timeline if p.assignment] for r in runs},
                result.phase_s / result.time_scale if result.phase_s else None,
            )
    return paths


# -- the command line ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser("tail", __doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke check under 2 minutes: load 0.8, warm-up 4 s, window 8 s, drain 12 s")
    add("--engines", type=int, default=4, help="simulated GPUs per set-up (default %(default)s)")
    add(
        "--split",
        default="1:3",
        help="disaggregated I:B, interactive latency engines : batch throughput engines, I+B = --engines; "
        "comma-separated for several (each split set-up runs on each) (default %(default)s)",
    )
    add("--loads", default=None, help="comma-separated loads, fractions of the shared capacity (default 0.5,0.8,1.0,1.3)")
    add("--traffic", choices=("poisson", "bursty"), default="poisson", help="arrival process (default %(default)s)")
    add("--burst-period", type=float, default=10.0, help="bursty: on half, off half of this many real s (default %(default)s)")
    add("--trace", type=Path, help="replay a JSONL trace (at GPU s, prompt_tokens, max_tokens, class) instead; --loads is ignored")
    add("--record-trace", type=Path, help="write the first load's generated schedule as a JSONL trace")
    add("--warmup", type=float, default=None, help="unmeasured arrivals before the window, real s (default 20)")
    add("--seconds", type=float, default=None, help="measured arrival window, real s (default 30)")
    add("--drain", type=float, default=None, help="longest wait after the last arrival, real s (default 30)")
    add_time_scale_arg(parser, 4.0, "the simulator's --time-scale; keeps its CPU and the router's low")
    add_seed_arg(parser, 1, "the arrivals")
    add("--setup", action="append", choices=SETUP_NAMES, help=f"run this set-up, repeatable (default: {', '.join(DEFAULT_SETUPS)})")
    add("--mix", choices=(*MIXES, "shift"), default="origin", help="traffic: the origin's, chat (short requests take most GPU time), "
        "or shift (chat, then the origin's, --phase-seconds each) (default %(default)s)")
    add("--phase-seconds", type=float, default=None, help="--mix shift: real s of each phase (default 120)")
    add("--seats", type=int, default=None, help="every engine's max_num_seqs (and its endpoint cap); default: the profiles' (64 latency, 256 throughput)")
    add("--lend-rule", action="append", default=None, metavar="RULE",
        help="the interactive pool's lending rule, e.g. prompt=512,reserve=8,seats=32,output=512; repeatable: one lend set-up "
        f"each, lend-rebalance takes the first (default {DEFAULT_LEND.label()})")
    add("--no-lend-back", action="store_true", help="in the lend set-ups, the batch pool lends nothing to interactive requests")
    add("--batch-relay-interval", type=float, default=0.0, metavar="S",
        help="the batch class's relay_interval in GPU seconds: its streams are read at most once per S (default 0: as events come)")
    add("--hold", type=float, default=RebalanceSpec.hold, help="[rebalance] hold_time, GPU s (default %(default)s)")
    add("--cooldown", type=float, default=RebalanceSpec.cooldown, help="[rebalance] cooldown, GPU s (default %(default)s)")
    add("--threshold", type=float, default=RebalanceSpec.threshold, help="[rebalance] threshold (default %(default)s)")
    add("--batch-seats", default="16", help="shared-limit: batch's class_max_concurrency per engine, comma-separated, one set-up each (default %(default)s)")
    add("--max-engines", type=int, default=0, help="run set-ups (and loads) at once while their engines add up to at most this "
        "(each on engines of its own); 0: one at a time (default %(default)s)")
    add("--baselines-each-round", action="store_true", help="with --max-engines: every round runs its own shared and short-only, "
        "and each set-up is compared with those (a busy machine's load changes between rounds)")
    add("--bins", type=float, default=0.0, help="GPU s per bin of the per-class series over time (default: 2 with --mix shift, else none)")
    add_out_arg(parser, RESULTS)
    add("--name", default=None, help="base name of the outputs (default tail, or tail-quick)")
    add("--samples", type=Path, default=None, help="also write every request's fate (JSONL, one file per set-up and load) to this folder")
    add(
        "--fail-fast-fraction",
        type=float,
        default=None,
        help="every pool's fail_fast_fraction in tailguard's config: 0 = requests wait and time out (the old behaviour); "
        "default: the router's own default",
    )
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    try:
        splits = [tuple(int(x) for x in item.split(":")) for item in args.split.split(",") if item.strip()]
        loads = [float(x) for x in (args.loads or ("0.8" if args.quick else "0.5,0.8,1.0,1.3")).split(",") if x.strip()]
        rules = [LendRule.parse(text) for text in args.lend_rule] if args.lend_rule else [DEFAULT_LEND]
        batch_seats = [int(x) for x in args.batch_seats.split(",") if x.strip()]
    except ValueError as error:
        parser.error(f"--split is I:B (integers), --loads comma-separated numbers, --batch-seats integers: {error}")
    setups = args.setup or DEFAULT_SETUPS
    needs_split = any(kind in SPLIT_KINDS for kind in setups)
    for split in splits:
        if len(split) != 2 or (needs_split and (split[0] < 1 or split[1] < 1 or sum(split) != args.engines)):
            parser.error(f"--split {args.split}: each I:B both >= 1 and summing to --engines {args.engines}")
    interactive, batch = splits[0]
    if not loads or min(loads) <= 0 or args.time_scale <= 0:
        parser.error("--loads and --time-scale must be > 0")
    quick = (4.0, 8.0, 12.0) if args.quick else (20.0, 30.0, 30.0)
    warmup, seconds, drain = (given if given is not None else default for given, default in zip((args.warmup, args.seconds, args.drain), quick))
    phase = args.phase_seconds if args.phase_seconds is not None else 120.0
    if args.mix == "shift":
        seconds = 2 * phase - warmup  # the window: from the warm-up's end to the last arrival
    if seconds <= 0 or warmup < 0 or drain < 0:
        parser.error("--seconds must be > 0, --warmup and --drain >= 0")
    if args.fail_fast_fraction is not None and not 0 <= args.fail_fast_fraction <= 1:
        parser.error("--fail-fast-fraction is between 0 and 1")
    return Options(
        engines=args.engines,
        split=(interactive, batch),
        loads=loads,
        traffic=args.traffic,
        burst_period=args.burst_period,
        trace=args.trace,
        record_trace=args.record_trace,
        warmup=warmup,
        seconds=seconds,
        drain=drain,
        time_scale=args.time_scale,
        seed=args.seed,
        setups=setups,
        out=args.out,
        name=args.name or ("tail-quick" if args.quick else "tail"),
        fail_fast_fraction=args.fail_fast_fraction,
        samples_dir=args.samples,
        splits=[(i, b) for i, b in splits],
        mix=args.mix,
        seats=args.seats,
        lend_rules=rules,
        lend_back=not args.no_lend_back,
        batch_relay_interval=args.batch_relay_interval,
        rebalance=RebalanceSpec(hold=args.hold, threshold=args.threshold, cooldown=args.cooldown),
        batch_seats=batch_seats,
        max_engines=args.max_engines,
        phase_seconds=phase if args.mix == "shift" else 0.0,
        bin_seconds=args.bins,
        baselines_each_round=args.baselines_each_round,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    started = time.perf_counter()
    result = run_trio(measure, options, ["python", "-m", "bench", "tail", *(argv or [])], said="the simulator and tailguard were stopped")
    if result is None:
        return 130
    table = render(result)
    print(table)
    for path in write_outputs(result, options, table):
        print(f"wrote {path}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0

