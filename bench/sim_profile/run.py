"""``python -m bench sim_profile``: TTFT and ITL against load for each engine profile.

Closed-loop clients submit straight to an ``Engine`` under Trio's MockClock,
so a minute of simulated traffic per row runs in about a second of wall time
and every number is deterministic (no sockets, no scheduling noise).

Clients start at seeded random offsets within the first half of the warm-up:
identical closed-loop clients started together stay in lock step forever
(they finish in the same step and resubmit together), and every TTFT would
then be the prefill of the whole cohort rather than of one arriving request.

After each response a client turns around in a seeded 0-10 ms (a client's
and network's reaction): arrivals then fall anywhere inside an engine step,
as real ones do. Resubmitting at the exact instant a request ends would put
every arrival on a step boundary, where it never waits behind a long prefill
step in progress, and would hide exactly the head-of-line blocking the mixed
rows are meant to show. Each client draws from its own generator, so the
table is identical on every run whatever Trio's scheduling order.

All times are simulated GPU time at time scale 1 (ms), so the table reads as
what one H100 running vLLM would show.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field

import trio
import trio.testing

from bench.harness.cli import add_json_arg, add_seconds_arg, add_seed_arg, add_warmup_arg, driver_parser, run_trio
from bench.harness.procs import RESULTS_ROOT
from bench.harness.report import md_table, save_json
from bench.harness.stats import percentile
from tailguard.sim.engine import Engine
from tailguard.sim.params import PROFILES
from tailguard.sim.sequence import Sequence

DEFAULT_JSON = RESULTS_ROOT / "sim_profile.json"
LEVELS = (1, 8, 32, 64, 128, 256)
PROFILE_NAMES = ("latency", "throughput")
TURNAROUND_MAX_S = 0.010


@dataclass(frozen=True)
class ClientKind:
    """One class of closed-loop client: its request shape and how many there are."""

    name: str
    count: int
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Scenario:
    """One row of the table: a profile under a mix of clients."""

    profile: str
    label: str
    kinds: tuple[ClientKind, ...]
    measured: str  # the kind whose latencies the row reports
    token_gaps: bool = False  # also record every inter-token gap of the measured kind


@dataclass
class Record:
    """What one finished request tells us, in seconds of simulated time."""

    kind: str
    ttft: float
    itl: float
    gaps: list[float] = field(default_factory=list)


@dataclass
class Row:
    """One line of the report (times in ms)."""

    profile: str
    clients: str
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    gap_p99_ms: float | None
    gap_max_ms: float | None
    output_tokens_per_s: float
    running_mean: float
    waiting_mean: float
    preemptions: int


class Finishes:
    """Wakes a client's task once, when its sequence ends (one wake per request).

    ``Sequence.wait_finished`` would wake the task on every token, which would
    make the simulation itself the slow part at high concurrency.
    """

    def __init__(self, engine: Engine) -> None:
        self._events: dict[str, trio.Event] = {}
        engine.add_finish_hook(self._on_finish)

    def event(self, sequence: Sequence) -> trio.Event:
        event = self._events[sequence.request_id] = trio.Event()
        return event

    def _on_finish(self, sequence: Sequence) -> None:
        event = self._events.pop(sequence.request_id, None)
        if event is not None:
            event.set()


@dataclass(frozen=True)
class Client:
    """One closed-loop client: what it sends, when it starts, how it turns around."""

    kind: ClientKind
    index: int
    start_at: float
    rng: random.Random  # its own, so draws do not depend on Trio's scheduling order
    follow_tokens: bool


async def _client(
    engine: Engine, finishes: Finishes, client: Client, window: tuple[float, float], records: list[Record]
) -> None:
    """Submit, wait for the end, turn around, submit again, until the window closes."""
    start, end = window
    kind = client.kind
    await trio.sleep_until(client.start_at)
    for number in itertools.count():
        if trio.current_time() >= end:
            return
        sequence = engine.submit(
            kind.prompt_tokens, kind.max_tokens, prompt_key=f"{kind.name}-{client.index}-{number}", ignore_eos=True
        )
        gaps: list[float] = []
        if client.follow_tokens:
            await _follow_tokens(sequence, gaps)
        else:
            await finishes.event(sequence).wait()
        if sequence.arrival >= start and sequence.finished_at is not None and sequence.finished_at <= end:
            record = _record(kind, sequence, gaps)
            if record is not None:
                records.append(record)
        await trio.sleep(client.rng.uniform(0, TURNAROUND_MAX_S))


def _record(kind: ClientKind, sequence: Sequence, gaps: list[float]) -> Record | None:
    if sequence.first_token_at is None or sequence.finished_at is None:
        return None
    produced = len(sequence.token_ids)
    itl = (sequence.finished_at - sequence.first_token_at) / (produced - 1) if produced > 1 else math.nan
    return Record(kind.name, sequence.first_token_at - sequence.arrival, itl, gaps)


async def _follow_tokens(sequence: Sequence, gaps: list[float]) -> None:
    """Wait token by token, keeping each inter-token gap (costs a wake per token)."""
    last: float | None = None
    seen = 0
    while not sequence.finished:
        await sequence.wait_for_tokens(seen)
        if len(sequence.token_ids) == seen:
            break  # ended without a new token
        seen = len(sequence.token_ids)
        now = trio.current_time()
        if last is not None:
            gaps.append(now - last)
        last = now


async def _sampler(engine: Engine, window: tuple[float, float], interval: float, out: list[tuple[int, int]]) -> None:
    """Sample running/waiting on a fixed simulated-time grid over the window."""
    start, end = window
    await trio.sleep_until(start)
    for tick in itertools.count():
        at = start + tick * interval
        if at >= end:
            return
        await trio.sleep_until(at)
        stats = engine.statistics()
        out.append((stats.running, stats.waiting))


async def run_scenario(scenario: Scenario, warmup: float, seconds: float, seed: int) -> Row:
    """Run one row's traffic in simulated time and summarize it."""
    engine = Engine(PROFILES[scenario.profile], name=scenario.profile)
    finishes = Finishes(engine)
    records: list[Record] = []
    samples: list[tuple[int, int]] = []
    now = trio.current_time()
    window = (now + warmup, now + warmup + seconds)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        nursery.start_soon(_sampler, engine, window, 0.01, samples)
        for kind in scenario.kinds:
            for index in range(kind.count):
                rng = random.Random(f"{seed}-{kind.name}-{index}")
                follow = scenario.token_gaps and kind.name == scenario.measured
                client = Client(kind, index, now + rng.uniform(0, warmup / 2), rng, follow)
                nursery.start_soon(_client, engine, finishes, client, window, records)
        await trio.sleep_until(window[0])
        tokens_before = engine.statistics().generation_tokens_total
        await trio.sleep_until(window[1])
        stats = engine.statistics()
        nursery.cancel_scope.cancel()
    tokens = stats.generation_tokens_total - tokens_before
    return _summarize(scenario, records, samples, tokens, seconds, stats.preemptions)


def _summarize(
    scenario: Scenario,
    records: list[Record],
    samples: list[tuple[int, int]],
    tokens: int,
    seconds: float,
    preemptions: int,
) -> Row:
    measured = [r for r in records if r.kind == scenario.measured]
    ttft = sorted(r.ttft * 1000 for r in measured)
    itl = sorted(r.itl * 1000 for r in measured if not math.isnan(r.itl))
    gaps = sorted(g * 1000 for r in measured for g in r.gaps)
    return Row(
        profile=scenario.profile,
        clients=scenario.label,
        requests=len(measured),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50),
        itl_p99_ms=percentile(itl, 99),
        gap_p99_ms=percentile(gaps, 99) if scenario.token_gaps else None,
        gap_max_ms=max(gaps) if scenario.token_gaps and gaps else None,
        output_tokens_per_s=tokens / seconds,
        running_mean=sum(r for r, _ in samples) / len(samples) if samples else math.nan,
        waiting_mean=sum(w for _, w in samples) / len(samples) if samples else math.nan,
        preemptions=preemptions,
    )


def build_scenarios(levels: Seq[int]) -> list[Scenario]:
    """Uniform rows at each concurrency level, then one mixed row, per profile."""
    scenarios: list[Scenario] = []
    for profile in PROFILE_NAMES:
        for level in levels:
            uniform = ClientKind("uniform", level, prompt_tokens=200, max_tokens=128)
            scenarios.append(Scenario(profile, str(level), (uniform,), measured="uniform"))
        short = ClientKind("short", 32, prompt_tokens=30, max_tokens=64)
        long = ClientKind("long", 4, prompt_tokens=2000, max_tokens=512)
        scenarios.append(Scenario(profile, "32 short + 4 long", (short, long), measured="short", token_gaps=True))
    return scenarios


async def run_all(scenarios: Seq[Scenario], warmup: float, seconds: float, seed: int) -> list[Row]:
    return [await run_scenario(scenario, warmup, seconds, seed) for scenario in scenarios]


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "—"
    return f"{value:,.1f}"


def render_table(rows: Seq[Row]) -> str:
    header = [
        "profile", "clients", "requests", "TTFT P50 ms", "TTFT P99 ms", "ITL P50 ms", "ITL P99 ms", "gap P99 ms", "gap max ms", "out tok/s",
        "running", "waiting", "preempt",
    ]
    return "\n".join(md_table(header, (
        (
            r.profile, r.clients, r.requests, *map(_ms, (r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms, r.itl_p99_ms, r.gap_p99_ms, r.gap_max_ms)),
            f"{r.output_tokens_per_s:,.0f}", f"{r.running_mean:.1f}", f"{r.waiting_mean:.1f}", r.preemptions,
        )
        for r in rows
    )))


def payload_of(rows: Seq[Row], warmup: float, seconds: float, seed: int, wall: float) -> dict[str, object]:
    """What the JSON file holds: the run's parameters, the profiles, a row per scenario."""
    return {
        "what": "closed-loop load on one simulated engine, virtual time (MockClock), time scale 1",
        "seed": seed,
        "warmup_s": warmup,
        "window_s": seconds,
        "wall_s": round(wall, 2),
        "profiles": {name: asdict(PROFILES[name]) for name in PROFILE_NAMES},
        "rows": [asdict(row) for row in rows],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add_seconds_arg(parser, 60.0, "simulated measurement window per row")
    add_warmup_arg(parser, 10.0, "simulated warm-up before each window; clients start spread over its first half")
    add_seed_arg(parser, 0, "the clients' start offsets")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels, comma-separated (default %(default)s)")
    add_json_arg(parser, DEFAULT_JSON)
    return parser


def main(argv: Seq[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(part) for part in args.levels.split(",") if part.strip()]
    scenarios = build_scenarios(levels)
    started = time.perf_counter()  # wall time of the whole run, for the reader only
    clock = trio.testing.MockClock(autojump_threshold=0)
    rows = run_trio(run_all, scenarios, args.warmup, args.seconds, args.seed, clock=clock, said="nothing to stop (virtual time)")
    if rows is None:
        return 130
    wall = time.perf_counter() - started
    print(render_table(rows))
    print(
        f"\nsimulated {args.warmup:g} s warm-up + {args.seconds:g} s window per row, time scale 1; "
        f"ITL = (last token - first token) / (tokens - 1) per request; gap = every inter-token gap "
        f"(mixed rows, short requests only); wall {wall:.1f} s"
    )
    save_json(args.json, payload_of(rows, args.warmup, args.seconds, args.seed, wall))
    return 0
