"""CPU clocks: the processes under test, this client, the whole machine."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from bench.harness.procs import process_cpu_seconds


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds of the processes under test and of this client, at one instant."""

    wall: float
    processes: dict[str, float]
    client: float

    @staticmethod
    def read(pids: dict[str, int]) -> CpuClock:
        return CpuClock(time.perf_counter(), {name: _cpu_seconds(name, pid) for name, pid in pids.items()}, time.process_time())

    def seconds_since(self, before: CpuClock) -> dict[str, float]:
        """CPU seconds of each process (and "client", this one) between ``before`` and now."""
        seconds = {name: cpu - before.processes[name] for name, cpu in self.processes.items()}
        seconds["client"] = self.client - before.client
        return seconds

    def cores_since(self, before: CpuClock) -> dict[str, float]:
        """Cores used by each process (and "client") between ``before`` and now."""
        wall = self.wall - before.wall
        return {name: seconds / wall for name, seconds in self.seconds_since(before).items()}


def _cpu_seconds(name: str, pid: int) -> float:
    try:
        return sum(process_cpu_seconds(pid))
    except FileNotFoundError:
        raise RuntimeError(f"{name} (pid {pid}) exited during the run") from None


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class MachineClock:
    """Busy CPU seconds of the whole machine (every core, every process), at one instant.

    Other work on a shared machine takes cores from the router; the
    machine's busy cores beside the measured processes' show how much.
    """

    wall: float
    busy: float

    @staticmethod
    def read() -> MachineClock:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = sum(values) - values[3] - values[4]
        return MachineClock(time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"))

    def cores_since(self, before: MachineClock) -> float:
        return (self.busy - before.busy) / max(self.wall - before.wall, 1e-9)
