"""The whole run: one simulated engine, tailguard afresh for each set-up (hint computed, then fixed), the same arrivals to each.

One after another, not side by side: on a small shared machine two
set-ups at once would take CPU from each other unevenly. Each logical
request is one SDK call, sent at its arrival and left to retry as the SDK
does; the run's bound (the last arrival plus ``drain``) cuts whatever is
still retrying then.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness.procs import free_ports, log_tail, start_tailguard, wait_ready
from bench.harness.report import RunRecord, Target
from bench.harness.serving import ready_process
from bench.harness.short_chat import start_engine
from bench.harness.traffic import poisson_offsets
from bench.harness.unique import run_seed
from bench.retry.model import HINTS, RETRY_AFTER_S, Options
from bench.retry.sdk import Attempts, Logical, max_tokens_of, sdk_client, send
from bench.retry.setups import router_config
from bench.retry.stats import SetupNumbers, summarise


@dataclass
class Result(RunRecord):
    """A run's numbers (``report.render`` writes them out)."""

    setups: list[SetupNumbers] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    load_average: dict[str, list[float]] = field(default_factory=dict)  # 1, 5, 15 min, at the start and the end
    window_start: float = 0.0  # the counted window's start, s from each set-up's first arrival: the histogram's first bin
    bin_s: float = 0.25
    wall_s: float = 0.0


@asynccontextmanager
async def tailguard(engine_port: int, options: Options, hint: str, tmp: Path, log: IO[bytes]) -> AsyncIterator[int]:
    """tailguard over the engine with ``retry_after_hint = HINT``; stopped on every path. Yields its HTTP port."""
    http, grpc = free_ports(2)
    path = tmp / f"tailguard-{hint}.toml"
    path.write_text(router_config(http, grpc, engine_port, options, hint=hint))
    async with ready_process(partial(start_tailguard, config=path, log=log), http, "tailguard"):
        yield http


async def measure(options: Options, result: Result, hints: Sequence[str] = HINTS) -> Result:
    """Each set-up in turn on one engine; the simulator and every tailguard stopped after, their log shown on a failure."""
    result.load_average["start"] = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="tailguard-retry-") as tmp:
        log_path = Path(tmp) / "processes.log"
        try:
            with log_path.open("wb") as log:
                (engine_port,) = free_ports(1)
                async with trio.open_nursery() as nursery:
                    engine = await start_engine(nursery, engine_port, options.seats, options.time_scale, options.seed, log)
                    await wait_ready(engine_port, engine, "the simulator")
                    for hint in hints:
                        async with tailguard(engine_port, options, hint, Path(tmp), log) as port:
                            logicals = await play(port, options, hint)
                        window = (options.warmup, options.horizon)
                        result.setups.append(summarise(hint, logicals, window, options.bin_s, RETRY_AFTER_S))
                        print(f"  {hint}: done", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
        except Exception:
            print(log_tail(log_path), file=sys.stderr)
            raise
    result.load_average["end"] = list(os.getloadavg())
    return result


async def play(port: int, options: Options, label: str) -> list[Logical]:
    """The seeded Poisson arrivals, each a logical request sent on time through one SDK client; all cut at the run's bound."""
    offsets = poisson_offsets(options.rate, options.horizon, run_seed(options.seed, "retry"))
    origin = trio.current_time()
    attempts = Attempts(origin)
    client = sdk_client(port, options, attempts)
    lengths = max_tokens_of(options.seed)
    logicals: list[Logical] = []

    async def one(logical: Logical, max_tokens: int) -> None:
        await send(client, logical, label, options.seed, max_tokens)
        logical.ended = trio.current_time() - origin

    try:
        with trio.move_on_at(origin + options.horizon + options.drain):
            async with trio.open_nursery() as nursery:
                for number, offset in enumerate(offsets):
                    await trio.sleep_until(origin + offset)
                    logical = Logical(number, trio.current_time() - origin)
                    attempts.by_id[f"{label}-{number}"] = logical
                    logicals.append(logical)
                    nursery.start_soon(one, logical, lengths())
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
    return logicals  # those the bound cut keep outcome "cut" and no end
