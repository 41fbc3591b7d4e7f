"""The run: every workload against every set-up, each set-up on fresh engines, set-ups of one workload side by side.

For each workload, every set-up starts its own simulator (four engines,
cold caches) and its own router, and all of them play the same schedule at
the same time (``parallel``; else one after another), so a busy shared
machine slows them alike. The engines' counters are read when the warm-up
ends and when the run ends.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness.clocks import CpuClock
from bench.harness.open_loop import Sample
from bench.harness.procs import free_ports, log_tail, wait_ready
from bench.prefix.drive import RAW_SHORT_THRESHOLD, conversations, open_loop
from bench.prefix.engines import EngineCounters, class_counts, placements, read_counters, scrape, start_engines
from bench.prefix.model import ENGINES, Workload
from bench.prefix.report import Measured, SetupRun, summarise
from bench.prefix.setups import PEER_POLICIES, SESSION_HEADER, Setup, file_name, running

PORTS_A_SETUP = ENGINES + 2  # the engines', the router's, and its metrics' (vllm-router) or gRPC's (tailguard)
SETTLE_S = 0.5  # real s between a run's end and the last read of the engines' counters


@dataclass(frozen=True)
class RunSpec:
    """What every set-up's run shares."""

    time_scale: float
    drain_s: float  # real s after the schedule's end
    kv_cache_tokens: int
    seed: int
    placement_ok: bool
    parallel: bool


async def measure_workload(workload: Workload, setups: Sequence[Setup], spec: RunSpec) -> list[SetupRun]:
    """``workload`` against each of ``setups``; their runs in set-up order."""
    found: dict[str, SetupRun] = {}
    picked = iter(free_ports(PORTS_A_SETUP * len(setups)))  # all at once, so no two set-ups get the same port
    ports = {s.name: [next(picked) for _ in range(PORTS_A_SETUP)] for s in setups}
    with tempfile.TemporaryDirectory(prefix="tailguard-prefix-") as tmp:
        logs = {s.name: Path(tmp) / f"{file_name(s.name)}.log" for s in setups}
        try:
            async with trio.open_nursery() as nursery:
                for setup in setups:
                    run = partial(_into, found, workload, setup, spec, Path(tmp), logs[setup.name], ports[setup.name])
                    if spec.parallel:
                        nursery.start_soon(run)
                    else:
                        await run()
        except Exception:
            for name, path in logs.items():
                print(f"--- {name} ---\n{log_tail(path)}", file=sys.stderr)
            raise
    return [found[s.name] for s in setups]


async def _into(
    found: dict[str, SetupRun], workload: Workload, setup: Setup, spec: RunSpec, tmp: Path, log_path: Path, ports: Sequence[int]
) -> None:
    with log_path.open("wb") as log:
        found[setup.name] = await run_setup(workload, setup, spec, tmp, log, ports)


async def run_setup(
    workload: Workload, setup: Setup, spec: RunSpec, tmp: Path, log: IO[bytes], ports: Sequence[int] | None = None
) -> SetupRun:
    """One set-up: its engines and router started, the workload played, its numbers; everything stopped after.

    ``ports``: PORTS_A_SETUP free ports, the engines' then the router's two (picked here when not given).
    """
    picked = list(ports) if ports is not None else free_ports(PORTS_A_SETUP)
    ports, router_ports = picked[:ENGINES], (picked[ENGINES], picked[ENGINES + 1])
    scale = spec.time_scale
    async with trio.open_nursery() as nursery:
        sim = await start_engines(nursery, ports, spec.kv_cache_tokens, scale, spec.seed, log)
        for port in ports:
            await wait_ready(port, sim, "the simulator")
        async with running(setup, ports, router_ports, scale, spec.placement_ok, tmp, log) as (port, router):
            pids = {"simulator": sim.pid, "router": router.pid}
            before = CpuClock.read(pids)
            at_warmup: dict[int, EngineCounters] = {}
            samples, prompts = await _play(workload, port, spec, SESSION_HEADER if setup.pin_header else None, ports, at_warmup, setup.name)
            cores = CpuClock.read(pids).cores_since(before)
            await trio.sleep(SETTLE_S)
            at_end = await read_counters(ports)
            page = None if setup.name in PEER_POLICIES else await scrape(port)
        nursery.cancel_scope.cancel()
    measured = Measured(samples, prompts, at_warmup, at_end, placements(page) if page else {}, class_counts(page) if page else {})
    return summarise(workload.name, setup.name, setup.description, measured, scale, RAW_SHORT_THRESHOLD, cores)


async def _play(
    workload: Workload, port: int, spec: RunSpec, pin: str | None, engines: Sequence[int], at_warmup: dict[int, EngineCounters], label: str
) -> tuple[list[Sample], list[int]]:
    """The open-loop requests or the conversations (whichever the workload has), the counters read at the warm-up's end."""
    scale = spec.time_scale
    samples: list[Sample] = []
    prompts: list[int] = []

    async def warmup_counters() -> None:
        await trio.sleep(workload.warmup_s * scale)
        at_warmup.update(await read_counters(engines))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(warmup_counters)
        if workload.conversations:
            window = (workload.warmup_s, workload.end_s)
            turned = await conversations(workload.conversations, port, scale, window, spec.drain_s, pin)
            samples, prompts = [t.sample for t in turned], [t.prompt_tokens for t in turned]
        else:
            samples = await open_loop(workload, port, scale, spec.drain_s, pin, label)
    return samples, prompts
