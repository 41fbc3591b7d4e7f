"""The whole run: one simulated engine, tailguard started afresh for each set-up, the set-ups one after another.

One after another, not at once: on a small shared machine two set-ups
side by side would take CPU from each other unevenly, and the ratios
compare latencies of a few tens of GPU milliseconds.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trio

from bench.harness.procs import free_ports, log_tail, wait_ready
from bench.harness.report import RunRecord, Target
from bench.harness.short_chat import start_engine
from bench.tenants.drive import Played, backlogged, open_loop, tailguard
from bench.tenants.model import B_FIRST_WEIGHT, BACKLOG_QUEUE_TIMEOUT_GPU_S, QUEUE_TIMEOUT_GPU_S, SETUPS, TENANTS, Options
from bench.tenants.stats import SetupNumbers, summarise
from bench.tenants.traffic import arrivals

DESCRIPTIONS = {
    "solo": "B alone, queue_order fair",
    "fair": "B and A's bursts, queue_order fair (weights 1:1)",
    "fifo": "B and A's bursts, queue_order arrival (first come, first served across callers)",
    "b-first": f"fair with weights A:B 1:{B_FIRST_WEIGHT:g}: B all but always next, the floor of waiting for a seat to free",
}
ORDERS = {"solo": "fair", "fair": "fair", "fifo": "arrival", "b-first": "fair"}
WEIGHTS = {"b-first": {"A": 1.0, "B": B_FIRST_WEIGHT}}  # else 1:1


@dataclass
class Result(RunRecord):
    """A run's numbers, scenario 1's set-ups and scenario 2 (``report.render`` writes them out)."""

    setups: list[SetupNumbers] = field(default_factory=list)
    weighted: SetupNumbers | None = None
    targets: list[Target] = field(default_factory=list)
    wall_s: float = 0.0
    seat_turnover_ms: float = math.nan  # GPU ms between seat releases with every seat busy (Options.service_gpu_ms / seats)


async def measure(options: Options, result: Result, setups: tuple[str, ...] = SETUPS, weighted: bool = True) -> Result:
    """Scenario 1's set-ups, then scenario 2 (weights, both backlogged); the simulator and every tailguard stopped after."""
    with tempfile.TemporaryDirectory(prefix="tailguard-tenants-") as tmp:
        log_path = Path(tmp) / "processes.log"
        try:
            with log_path.open("wb") as log:
                await _measure(options, result, setups, weighted, Path(tmp), log)
        except Exception:
            print(log_tail(log_path), file=sys.stderr)
            raise
    return result


async def _measure(options: Options, result: Result, setups: tuple[str, ...], weighted: bool, tmp: Path, log: IO[bytes]) -> None:
    (engine_port,) = free_ports(1)
    window = (options.warmup, options.horizon)
    async with trio.open_nursery() as nursery:
        engine = await start_engine(nursery, engine_port, options.seats, options.time_scale, options.seed, log)
        await wait_ready(engine_port, engine, "the simulator")
        for name in setups:
            weights = WEIGHTS.get(name, dict.fromkeys(TENANTS, 1.0))
            async with tailguard(engine_port, options, ORDERS[name], weights, QUEUE_TIMEOUT_GPU_S, tmp, log) as port:
                played = await open_loop(port, engine_port, options, arrivals(options, with_a=name != "solo"), name)
            result.setups.append(_summary(name, DESCRIPTIONS[name], played, options, window))
            print(f"  {name}: done in {played.wall_s:.0f} s", file=sys.stderr, flush=True)
        if weighted:
            weights = dict(zip(TENANTS, options.weights))
            async with tailguard(engine_port, options, "fair", weights, BACKLOG_QUEUE_TIMEOUT_GPU_S, tmp, log) as port:
                played = await backlogged(port, engine_port, options, "weighted")
            what = f"both backlogged ({options.outstanding} streams each), weights A:B {options.weights[0]:g}:{options.weights[1]:g}"
            backlog_window = (options.backlog_warmup, options.backlog_warmup + options.backlog_seconds)
            result.weighted = _summary("weighted", what, played, options, backlog_window)
            print(f"  weighted: done in {played.wall_s:.0f} s", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()


def _summary(name: str, description: str, played: Played, options: Options, window: tuple[float, float]) -> SetupNumbers:
    return summarise(name, description, played, options.seats, options.time_scale, window)
