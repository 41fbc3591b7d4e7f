"""The shared-prefix benchmark's numbers: per set-up and workload, the ratios between set-ups, the issue's targets, the markdown.

Latencies are GPU time (real divided by the time scale), in ms. The hit
rate is the engines' own: ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries`` (tokens), summed over the four engines,
between the warm-up's end and the run's end. Engine load is the requests
each engine finished over the whole run (``vllm:request_success``): max
over mean, 1.0 for a perfectly even spread.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bench.harness.open_loop import Sample, class_stats
from bench.harness.report import Target, md_table, targets_table
from bench.prefix.engines import EngineCounters
from bench.prefix.setups import CACHE_AWARE, CACHE_AWARE_TUNED, HAND, HINTED, LEAST_LOADED, TAILGUARD
from tailguard.server.advise.replay.mix import percentile


@dataclass
class SetupRun:
    """One set-up on one workload: the short requests' latencies, the cache, the spread, the failures, the CPU."""

    workload: str
    setup: str
    description: str
    n: int  # measured short requests
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    hit_rate: float  # warm-up end to run end
    hit_rate_run: float  # the whole run
    engine_requests: list[float]
    load_max_over_mean: float
    preemptions: float
    prefilled_tokens: float  # the whole run, all engines: prompt tokens actually prefilled
    errors: int  # requests (any kind, measured or not) that ended in an error
    cut: int  # measured requests still running when the run ended
    outcomes: dict[str, int]
    cores: dict[str, float]
    long_e2e_p99_ms: float = math.nan
    over_threshold: int = 0  # measured turns whose raw prompt was over the short threshold
    over_threshold_ttft_p99_ms: float = math.nan
    placements: dict[str, float] = field(default_factory=dict)
    classes: dict[str, float] = field(default_factory=dict)  # tailguard's finished requests by class, the whole run


@dataclass
class Result:
    """The whole run."""

    command: list[str]
    code: str
    time_scale: float
    times_are: str
    engines: str
    kv_sizing: str
    placement: str  # what tailguard's pools could be told
    load: float
    workloads: dict[str, dict[str, object]] = field(default_factory=dict)  # name -> description, rate, capacity, request count
    runs: list[SetupRun] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_count: int = 0
    load_average: dict[str, list[float]] = field(default_factory=dict)  # the machine's, at the start and the end (others' work too)


def load_spread(requests: Sequence[float]) -> float:
    """Max over mean of the requests each engine served (NaN when none were)."""
    mean = sum(requests) / len(requests) if requests else 0.0
    return max(requests) / mean if mean > 0 else math.nan


def hit_rate(counters: Mapping[int, EngineCounters]) -> float:
    """Prefix-cache hits over queries, tokens, summed over the engines."""
    queries = sum(c.queries for c in counters.values())
    return sum(c.hits for c in counters.values()) / queries if queries else math.nan


@dataclass(frozen=True)
class Measured:
    """What a run left to summarise: the samples, the turns' raw prompt sizes, and the engines' counters."""

    samples: Sequence[Sample]
    turn_prompts: Sequence[int]  # per sample of a conversation: its raw prompt tokens (empty for open loop)
    at_warmup: Mapping[int, EngineCounters]
    at_end: Mapping[int, EngineCounters]
    placements: Mapping[str, float] = field(default_factory=dict)  # tailguard's placement decisions (its /metrics), by kind
    classes: Mapping[str, float] = field(default_factory=dict)  # tailguard's finished requests (its /metrics), by class


def summarise(
    workload: str, setup: str, description: str, measured: Measured, scale: float, threshold: int, cores: dict[str, float]
) -> SetupRun:
    """One SetupRun from a run's samples and the engines' counters (at the warm-up's end and at the end)."""
    samples = measured.samples
    short = class_stats("short", samples, scale, 0.0, None)
    ttft, e2e = latencies(samples, "short", scale)
    window = {port: end.minus(measured.at_warmup.get(port, EngineCounters())) for port, end in measured.at_end.items()}
    served = [c.requests for _, c in sorted(measured.at_end.items())]
    over = [
        s.ttft / scale * 1000
        for s, tokens in zip(samples, measured.turn_prompts)
        if s.measured and tokens > threshold and s.outcome == "ok" and s.ttft is not None
    ]
    return SetupRun(
        workload=workload,
        setup=setup,
        description=description,
        n=short.n,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_p99_ms=percentile(e2e, 99),
        hit_rate=hit_rate(window),
        hit_rate_run=hit_rate(measured.at_end),
        engine_requests=served,
        load_max_over_mean=load_spread(served),
        preemptions=sum(c.preemptions for c in measured.at_end.values()),
        prefilled_tokens=sum(c.prefilled for c in measured.at_end.values()),
        errors=sum(1 for s in samples if s.outcome not in ("ok", "cut")),
        cut=sum(1 for s in samples if s.measured and s.outcome == "cut"),
        outcomes=short.outcomes,
        cores=cores,
        long_e2e_p99_ms=percentile(latencies(samples, "long", scale)[1], 99),
        over_threshold=sum(1 for s, tokens in zip(samples, measured.turn_prompts) if s.measured and tokens > threshold),
        over_threshold_ttft_p99_ms=percentile(sorted(over), 99),
        placements=dict(measured.placements),
        classes=dict(measured.classes),
    )


def latencies(samples: Sequence[Sample], kind: str, scale: float) -> tuple[list[float], list[float]]:
    """The measured ``kind`` requests' TTFT and E2E, GPU ms, sorted; one still running at the run's end counts as slower than all.

    A request cut by the run's bound has no E2E (and no TTFT if no token
    came): it is counted as infinitely slow, so a set-up that leaves many
    behind cannot look fast by their absence. Failed requests are left out
    (they are counted as errors).
    """
    ttft: list[float] = []
    e2e: list[float] = []
    for s in samples:
        if s.kind != kind or not s.measured or s.outcome not in ("ok", "cut"):
            continue
        ttft.append(math.inf if s.ttft is None else s.ttft / scale * 1000)
        e2e.append(math.inf if s.outcome == "cut" or s.e2e is None else s.e2e / scale * 1000)
    return sorted(ttft), sorted(e2e)


def ratio(a: float, b: float) -> float:
    """a / b, NaN where either is missing or b is 0."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def _run(result: Result, workload: str, setup: str) -> SetupRun | None:
    return next((r for r in result.runs if r.workload == workload and r.setup == setup), None)


def _bound(name: str, mine: SetupRun | None, other: SetupRun | None, metric: str, factor: float, peer: str) -> Target | None:
    """Target ``mine.metric <= factor x other.metric``, or None when either was not run."""
    if mine is None or other is None:
        return None
    value = ratio(getattr(mine, metric), getattr(other, metric))
    label = {"ttft_p50_ms": "short TTFT P50", "ttft_p99_ms": "short TTFT P99", "e2e_p99_ms": "short E2E P99"}[metric]
    measured = f"{getattr(mine, metric):.0f} / {getattr(other, metric):.0f} ms = {value:.2f}x"
    return Target(f"{name}: {label}", f"<= {factor:g}x {peer}", measured, not math.isnan(value) and value <= factor)


def targets(result: Result) -> list[Target]:
    """The issue's targets for tailguard's default set-up, where both sides of a target were run."""
    found: list[Target | None] = []
    tg = _run(result, "tenants", TAILGUARD)
    hand, aware = _run(result, "tenants", HAND), _run(result, "tenants", CACHE_AWARE)
    found += [_bound("tenants", tg, hand, "ttft_p50_ms", 1.5, HAND), _bound("tenants", tg, hand, "ttft_p99_ms", 1.0, HAND)]
    found += [_bound("tenants", tg, hand, "e2e_p99_ms", 1.0, HAND)]
    found += [_bound("tenants", tg, aware, metric, 1.0, CACHE_AWARE) for metric in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms")]
    if tg is not None:
        spread = tg.load_max_over_mean
        found.append(Target("tenants: engine load", "max/mean <= 1.3", f"{spread:.2f}", spread <= 1.3))
    found.append(
        _bound(
            "multi-turn", _run(result, "multi-turn", TAILGUARD), _run(result, "multi-turn", LEAST_LOADED), "ttft_p99_ms", 0.5, LEAST_LOADED
        )
    )
    found.append(
        _bound("unique", _run(result, "unique", TAILGUARD), _run(result, "unique", LEAST_LOADED), "ttft_p99_ms", 1.05, LEAST_LOADED)
    )
    return [t for t in found if t is not None]


def _f(value: float, spec: str = ".0f") -> str:
    return "-" if math.isnan(value) else format(value, spec)


def workload_table(runs: Sequence[SetupRun]) -> list[str]:
    """One workload's set-ups, side by side."""
    header = ["set-up", "short n", "TTFT P50 ms", "TTFT P99 ms", "E2E P99 ms", "hit rate", "load max/mean", "preempted", "errors", "cut"]
    rows = [
        (
            r.setup, r.n, _f(r.ttft_p50_ms), _f(r.ttft_p99_ms), _f(r.e2e_p99_ms), _f(r.hit_rate, ".2f"),
            _f(r.load_max_over_mean, ".2f"), _f(r.preemptions), r.errors, r.cut,
        )
        for r in runs
    ]  # fmt: skip
    return md_table(header, rows)


def ratios_table(result: Result, workload: str) -> list[str]:
    """tailguard's short TTFT P50 / P99 and E2E P99 over each peer's, on ``workload``."""
    tg = _run(result, workload, TAILGUARD)
    if tg is None:
        return []
    rows = []
    for peer in (HAND, LEAST_LOADED, CACHE_AWARE, CACHE_AWARE_TUNED, HINTED):
        other = _run(result, workload, peer)
        if other is not None:
            cells = (
                ratio(tg.ttft_p50_ms, other.ttft_p50_ms),
                ratio(tg.ttft_p99_ms, other.ttft_p99_ms),
                ratio(tg.e2e_p99_ms, other.e2e_p99_ms),
            )
            rows.append((f"tailguard / {peer}", *(_f(c, ".2f") for c in cells), f"{tg.hit_rate:.2f} vs {other.hit_rate:.2f}"))
    return md_table(["ratio", "TTFT P50", "TTFT P99", "E2E P99", "hit rate"], rows)


def render(result: Result) -> str:
    """The report: the command, the set-up, one table and its ratios per workload, the targets."""
    lines = [
        "# Shared-prefix benchmark",
        "",
        f"command: `{shlex.join(result.command)}`",
        f"code: {result.code}",
        f"engines: {result.engines}",
        f"KV cache: {result.kv_sizing}",
        f"tailguard placement: {result.placement}",
        f"times: {result.times_are} (time scale {result.time_scale:g}); load {result.load:g} of each workload's modelled capacity "
        "(every prompt token prefilled, seats as many as the KV cache holds: no reuse)",
        f"wall {result.wall_s:.0f} s on {result.cpu_count} CPU(s); load average "
        + " -> ".join(f"{when} {'/'.join(f'{x:.1f}' for x in values)}" for when, values in result.load_average.items()),
    ]
    for name, info in result.workloads.items():
        runs = [r for r in result.runs if r.workload == name]
        lines += ["", f"## {name}", "", str(info["description"]), ""]
        lines.append(
            f"{info['requests']} requests, {float(str(info['rate_req_s'])):.1f} GPU req/s = {result.load:g} x capacity {float(str(info['capacity_req_s'])):.1f}"
        )
        lines += ["", *workload_table(runs), "", *ratios_table(result, name)]
        over = [r for r in runs if r.over_threshold]
        if over:
            lines += [
                "",
                "turns over the raw-length short threshold (500 tokens): "
                + "; ".join(f"{r.setup} {r.over_threshold}, TTFT P99 {_f(r.over_threshold_ttft_p99_ms)} ms" for r in over),
            ]
        decided = [f"{r.setup} " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.placements.items())) for r in runs if r.placements]
        if decided:
            lines += ["", "tailguard's placement decisions (tailguard_placements_total): " + "; ".join(decided)]
        classed = [r for r in runs if len(r.classes) > 1]
        if classed:
            by_class = "; ".join(f"{r.setup} " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.classes.items())) for r in classed)
            lines += ["", f"requests by class, the whole run (tailguard_requests_total): {by_class}"]
        spread = "; ".join(f"{r.setup} " + "/".join(f"{v:.0f}" for v in r.engine_requests) for r in runs)
        lines += ["", f"requests served per engine: {spread}"]
        cores = "; ".join(f"{r.setup} " + " / ".join(f"{k} {v:.2f}" for k, v in r.cores.items()) for r in runs)
        lines += ["", f"cores: {cores}"]
    lines += ["", "## Targets (tailguard's default set-up)", "", *targets_table(result.targets)]
    lines += [f"- {note}" for note in ["", *result.notes][1:]] if result.notes else []
    return "\n".join(lines)
