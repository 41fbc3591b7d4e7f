"""tailguard as one set-up runs it: its own process, and its log for that set-up."""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio

from bench.harness.procs import free_ports, start_tailguard
from bench.harness.serving import ready_process
from bench.tail.model import ROUTER_LOG_LEVEL, Options, Setup
from bench.tail.setups import router_config

T = TypeVar("T")


def slug(name: str) -> str:
    """A set-up's name as a file-name piece."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


@dataclass(frozen=True)
class RunningRouter:
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
async def running_router(setup: Setup, options: Options, tmp: Path, load: float = math.nan) -> AsyncIterator[RunningRouter | None]:
    """tailguard for ``setup`` in its own process (none for the direct set-ups); stopped on every path.

    It logs at the shipped level (INFO), so its access log times every request.
    """
    if not setup.pools:
        yield None
        return
    http_port, grpc_port = free_ports(2)
    config = tmp / f"{slug(setup.name)}-{load:g}.toml"
    config.write_text(router_config(http_port, grpc_port, setup, options.time_scale, options.fail_fast_fraction, options.batch_relay_interval))
    log_path = tmp / f"tailguard-{slug(setup.name)}-{load:g}.log"  # one each: set-ups may run at once
    with log_path.open("ab") as log:
        log_from = log.tell()
        start = partial(start_tailguard, config=config, log=log, extra_args=["--log-level", ROUTER_LOG_LEVEL])
        async with ready_process(start, http_port, "tailguard") as process:
            yield RunningRouter(http_port, process, log_path, log_from)
