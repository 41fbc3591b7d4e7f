"""What the tail benchmark's modules share: its constants, options, set-ups and result types."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.config import PoolSpec
from bench.harness.open_loop import ClassStats
from bench.harness.procs import RESULTS_ROOT
from bench.harness.toml import TomlTable, TomlValue

RESULTS = RESULTS_ROOT / "tail"


DEFAULT_SETUPS = ("shared", "priority", "disaggregated", "split-direct", "short-only")


SETUP_NAMES = (*DEFAULT_SETUPS, "lend", "rebalance", "lend-rebalance", "shared-limit", "vllm-priority")


SPLIT_KINDS = ("disaggregated", "split-direct", "lend", "rebalance", "lend-rebalance")  # set-ups on the I:B split


TAILGUARD_SPLIT_KINDS = ("disaggregated", "lend", "rebalance", "lend-rebalance")


BASELINES = ("shared", "short-only")  # what the others are measured against (--baselines-each-round copies them)


ENGINE_PROBE_S = 0.5  # real s between two looks at every engine's running and waiting counts




ADDED_TTFT_GOAL_MS = 10.0  # real ms: short TTFT P99 through tailguard over the same split fed directly, at load 0.8


SHORT_DEADLINE_S = 3.0  # GPU s: the interactive class's queue_timeout in the shipped config


QUEUE_TIMEOUTS = {"interactive": 3.0, "batch": 110.0}  # GPU s, as shipped


CLASS_OF = {"short": "interactive", "long": "batch"}  # reporting class -> tailguard class


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
    prefills: int | None = None  # borrowed requests in prefill at once per endpoint (the stall bound)
    when: str = "full"  # "full" | "busier" (LendConfig.when)
    ttft_ms: int | None = None  # LendConfig.ttft_budget, GPU ms (the config gets it times the time scale)
    max_imbalance: float | None = None  # LendConfig.max_imbalance: the share of seats past which the prompt bound yields

    _KEYS = {
        "prompt": "max_prompt_tokens",
        "reserve": "reserve",
        "seats": "max_seats",
        "output": "max_output_tokens",
        "prefills": "prefills",
        "when": "when",
        "ttft": "ttft_ms",
        "imbalance": "max_imbalance",
    }

    @classmethod
    def parse(cls, text: str) -> LendRule:
        """``prompt=512,reserve=8,seats=32,output=512,prefills=1,when=busier,ttft=50,imbalance=0.1`` (any of them; "none" or absent: unbounded)."""
        values: dict[str, int | float | str | None] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in cls._KEYS:
                raise ValueError(f"--lend-rule {text!r}: {key!r} is not one of {', '.join(cls._KEYS)}")
            if key == "when":
                if value not in ("full", "busier"):
                    raise ValueError(f"--lend-rule {text!r}: when is full or busier, not {value!r}")
                values["when"] = value
            elif key == "imbalance":
                values["max_imbalance"] = None if value in ("none", "") else float(value)
            else:
                values[cls._KEYS[key]] = None if value in ("none", "") else int(value)
        if values.get("reserve") is None:
            values["reserve"] = 0
        return cls(**values)  # type: ignore[arg-type]

    def label(self) -> str:
        """Short name: p512 r8 s32 o512 f1 busier (p- = no prefill budget)."""
        prompt = "-" if self.max_prompt_tokens is None else str(self.max_prompt_tokens)
        parts = [f"p{prompt}", f"r{self.reserve}"]
        parts += [f"s{self.max_seats}"] if self.max_seats is not None else []
        parts += [f"o{self.max_output_tokens}"] if self.max_output_tokens is not None else []
        parts += [f"f{self.prefills}"] if self.prefills is not None else []
        parts += [self.when] if self.when != "full" else []
        parts += [f"t{self.ttft_ms}"] if self.ttft_ms is not None else []
        parts += [f"i{self.max_imbalance:g}"] if self.max_imbalance is not None else []
        return " ".join(parts)

    def table(self, lender: str, borrower: str, time_scale: float = 1.0) -> TomlTable:
        """``[pools.LENDER.lend]`` lending to ``borrower``; the TTFT budget in real s."""
        lend: dict[str, TomlValue] = {"to": [borrower], "reserve": self.reserve, "when": self.when}
        for key in ("max_seats", "max_prompt_tokens", "max_output_tokens", "prefills", "max_imbalance"):
            value = getattr(self, key)
            if value is not None:
                lend[key] = value
        if self.ttft_ms is not None:
            lend["ttft_budget"] = self.ttft_ms / 1000 * time_scale
        return {"pools": {lender: {"lend": lend}}}


# The default lending rule, chosen by measurement (bench/results/tail/tail-issue12.md): a borrowed
# prompt of at most 512 tokens adds at most 512 / 25 = 20 GPU ms to one step of a latency engine
# (prefill at 25 tokens/ms); a 2,021-token document adds 81 ms, and a few of those in a short
# request's life were enough to double its P99 on 2 engines.
DEFAULT_LEND = LendRule(max_prompt_tokens=512, reserve=4)
# What the batch pool lends back to interactive requests, as config.toml's [pools.batch.lend]: unbounded,
# whenever its engine is the less busy one for the request (bench/results/trace/issue35/cost-busier.md).
LEND_BACK = LendRule(when="busier")


@dataclass(frozen=True)
class RebalanceSpec:
    """``[rebalance]`` in GPU seconds (the config gets them times the time scale)."""

    interval: float = 0.25
    hold: float = 3.0
    threshold: float = 0.3
    cooldown: float = 6.0

    def table(self, scale: float) -> TomlTable:
        hold_time = max(self.hold, self.interval) * scale
        return {"rebalance": {"interval": self.interval * scale, "hold_time": hold_time, "threshold": self.threshold, "cooldown": self.cooldown * scale}}


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
    interactive_profile: str = "latency"  # the split's interactive engines: tuned for latency, or as the batch ones
    batch_relay_interval: float = 0.0  # the batch class's relay_interval, GPU seconds (0: each event as it comes)
    rebalance: RebalanceSpec = RebalanceSpec()
    batch_seats: Sequence[int] = (16,)  # shared-limit: batch's class_max_concurrency per endpoint, one set-up each
    max_engines: int = 0  # run set-ups at once while their engines add up to at most this; 0: one at a time
    phase_seconds: float = 0.0  # shift: real s of each phase
    bin_seconds: float = 0.0  # GPU s per bin of the over-time series; 0: none (shift: 2)
    baselines_each_round: bool = False  # with max_engines: every round runs its own shared and short-only
    prefix_caching: bool = True  # the simulated engines' prefix cache (--prefix-caching); prompts are unique either way


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
    tables: TomlTable = field(default_factory=dict)  # more config after the pools: lend tables, [rebalance]
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
    prefix_caching: bool | None = None  # the engines' prefix cache; None: a result from before issue 22 (no cache, one body per shape)
    notes: list[str] = field(default_factory=list)
    runs: list[SetupResult] = field(default_factory=list)
    checks: list[dict[str, object]] = field(default_factory=list)
