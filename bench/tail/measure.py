"""The tail benchmark's run: the schedules, the rounds of set-ups, one set-up's run and its numbers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import trio

from bench.harness.cli import same_named
from bench.harness.clocks import CpuClock
from bench.harness.config import MODEL
from bench.harness.open_loop import Sample, TokenPool, class_stats, play, token_times, write_samples
from bench.harness.procs import log_tail, start_process, wait_ready
from bench.harness.stats import percentile
from bench.harness.unique import ShapeRequests, run_seed
from bench.tail.checks import checks, checks12
from bench.tail.model import BASELINES, CLASS_OF, QUEUE_TIMEOUTS, SHORT_DEADLINE_S, EngineWatch, Options, Probe, Result, Setup, SetupResult
from bench.tail.router import RunningRouter, running_router, slug
from bench.tail.setups import build_plans, build_setups, capacities, engine_params, setup_capacity, split_capacity
from bench.tail.watch import join_access_log, rss_summary, watch_engines, watch_router
from tailguard.router.admission import effective_max_tokens
from tailguard.router.config import LimitsConfig
from tailguard.server.advise.replay.mix import CLASSES, MIXES, Shape, pooled_capacity, shapes_by_class, unique_body_for
from tailguard.server.advise.replay.trace import Arrival, generated, mix_of, phased, read_trace, write_trace


async def measure(options: Options, command: list[str]) -> Result:
    """Start the simulators, then play every load against every set-up (several at once under --max-engines)."""
    interactive, batch = options.split
    schedules, mix, caps = _schedules(options)
    result = _new_result(options, command, mix, caps)
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


def _new_result(options: Options, command: list[str], mix: dict[str, list[tuple[float, int, int]]], caps: dict[str, float]) -> Result:
    """The run's result before any set-up ran: its parameters, the mix and the capacities."""
    return same_named(
        Result,
        options,
        command=command,
        split=", ".join(f"{i}:{b}" for i, b in (options.splits or [options.split])),
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
        short_deadline_s=SHORT_DEADLINE_S,
        cpu_count=len(os.sched_getaffinity(0)),
        load_average={"start": [round(x, 2) for x in os.getloadavg()]},
        mix_name="trace" if options.trace else options.mix,
        lend_rules=[rule.label() for rule in options.lend_rules],
        rebalance=asdict(options.rebalance),
        phase_s=options.phase_seconds,
    )


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
    command += ["--prefix-caching", "true" if options.prefix_caching else "false"]
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
    async with running_router(setup, options, tmp, load) as router:
        if setup.by_kind:
            by_kind = {k: [TokenPool(p) for p in setup.by_kind[k]] for k in CLASSES}
        else:
            everyone = [TokenPool(p) for p in ([router.port] if router else setup.direct)]
            by_kind = {k: everyone for k in CLASSES}  # one list: one round robin over both classes
        pools = list({id(pool): pool for group in by_kind.values() for pool in group}.values())
        # Every request unique (the engines cache prefixes); a seed per set-up and load, as the engines outlive a run.
        request_of = ShapeRequests(run_seed(options.seed, load, setup.name), forwarded_body if setup.by_kind else unique_body_for)

        pids = {"simulator": sim.pid} | ({"tailguard": router.process.pid} if router else {})
        try:
            async with trio.open_nursery() as nursery:
                origin, wall_origin = time.perf_counter(), time.time()
                if router:
                    nursery.start_soon(watch_router, router, origin, timeline)
                nursery.start_soon(watch_engines, engine_watch, origin, options.mix == "shift")
                before = CpuClock.read(pids)
                label = f"load {load:.2f} {setup.name}"
                samples, wall = await play(by_kind, request_of, played, options.drain, label, progress=concurrent == 1)
                cores = CpuClock.read(pids).cores_since(before)
                nursery.cancel_scope.cancel()
        finally:
            for pool in pools:
                await pool.aclose()
    joined = join_access_log(router, samples) if router else math.nan
    moves = _moves_in_log(router, wall_origin) if router else []
    if options.samples_dir:
        write_samples(options.samples_dir / f"{options.name}-{slug(setup.name)}-load{load:g}.jsonl", samples)
    await trio.sleep(1.0)  # aborted sequences leave the engines before the next set-up
    window = _window(played, options)
    served = (options.warmup, options.warmup + window)
    deadline = {"short": SHORT_DEADLINE_S}
    lags = sorted(s.lag for s in samples)
    classes = [
        class_stats(k, samples, options.time_scale, window, deadline.get(k), QUEUE_TIMEOUTS[CLASS_OF[k]], served) for k in CLASSES
    ]
    outcomes_all, failures = _outcomes(samples)
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
        router_rss_mib=rss_summary(timeline, options),
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


def _outcomes(samples: Sequence[Sample]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Outcomes by class, and each kind of failure (class, outcome, status, code) with its count."""
    outcomes_all: dict[str, dict[str, int]] = {}
    failures: dict[str, int] = {}
    for s in samples:
        outcomes_all.setdefault(s.kind, {})
        outcomes_all[s.kind][s.outcome] = outcomes_all[s.kind].get(s.outcome, 0) + 1
        if s.outcome not in ("ok", "cut"):
            what = f"{s.kind} {s.outcome}: " + ("no reply" if s.status is None else f"{s.status} {s.code or ''}".strip())
            what += f", {s.tokens} tokens" if s.status == 200 else ""
            failures[what] = failures.get(what, 0) + 1
    return outcomes_all, failures


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


def _moves_in_log(router: RunningRouter, wall_origin: float) -> list[tuple[float, str]]:
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


def forwarded_body(prompt: int, max_tokens: int, number: int, *, seed: int = 0) -> dict[str, object]:
    """The body tailguard sends an engine for request ``number`` (``router.request_path.backend_body``), so ``split-direct`` sends the same.

    The client's unique body plus the pool's model, with max_tokens after the
    output cap of the limits every generated config leaves at their defaults.
    """
    body = unique_body_for(prompt, max_tokens, number, seed=seed)
    capped, _ = effective_max_tokens(max_tokens, LimitsConfig())
    return {"model": MODEL, "messages": body["messages"], "max_tokens": capped, "stream": body["stream"], "ignore_eos": True}


def _window(arrivals: Sequence[Arrival], options: Options) -> float:
    """Real seconds the measured arrivals span (the window, or less for a short trace)."""
    measured = [a.at for a in arrivals if a.measured]
    return min(options.seconds, measured[-1] - options.warmup) if measured else 0.0
