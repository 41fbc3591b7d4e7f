"""Holding many streams open: when the ramp stops, sampling the peak while they are held, waiting for the router to settle.

``hold`` (HTTP SSE) and ``grpc_overhead`` (gRPC ``ChatStream``) open thousands
of streams the same way; this is the one copy of the rules they report by.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from bench.harness.procs import ProcSample, proc_sample


class Ramp:
    """Whether opening ``target`` streams is over: all opened or failed, or no progress for ``stall_s``.

    The caller bounds the ramp with ``trio.move_on_after(timeout_s)``;
    ``stopped_because`` says which of the three ended it (the timeout unless
    ``done`` said otherwise).
    """

    def __init__(self, target: int, timeout_s: float, stall_s: float, started: float) -> None:
        self.target = target
        self.stall_s = stall_s
        self.stopped_because = f"ramp timeout ({timeout_s:g} s)"
        self._last_progress = -1
        self._progress_at = started

    def done(self, progress: int, now: float) -> bool:
        """``progress``: streams that opened, failed or ended so far (``now``: ``time.perf_counter()``)."""
        if progress >= self.target:
            self.stopped_because = "every stream opened or failed"
            return True
        if progress != self._last_progress:
            self._last_progress, self._progress_at = progress, now
        elif now - self._progress_at >= self.stall_s:
            self.stopped_because = f"no progress for {self.stall_s:g} s"
            return True
        return False


def higher(peak: ProcSample, sample: ProcSample) -> ProcSample:
    """The sample with the larger RSS (the peak so far)."""
    return max(peak, sample, key=lambda s: s.rss_mib)


async def hold_peak(pid: int, peak: ProcSample, start: float, open_now: Callable[[], int], seconds: float, every: float) -> ProcSample:
    """Hold for ``seconds``, sampling ``pid`` every ``every`` s so the peak stays honest; return the peak."""
    with trio.move_on_after(seconds):
        while True:
            await trio.sleep(every)
            peak = higher(peak, proc_sample(pid, "peak (ramp + hold)", start, open_now()))
    return peak


async def settle(
    pid: int, baseline: ProcSample, start: float, moment: str, open_now: Callable[[], int], *, threads: bool, timeout: float, fd_slack: int, every: float
) -> tuple[float, ProcSample]:
    """Wait (bounded) until ``pid``'s fds (and, with ``threads``, its threads) are back near ``baseline``; then a last reading.

    Returns the seconds waited and the final sample, taken a second after the
    wait so the last frees land.
    """
    began = time.perf_counter()

    def read() -> ProcSample:
        return proc_sample(pid, moment, start, open_now())

    def above(sample: ProcSample) -> bool:
        return (threads and sample.threads > baseline.threads) or sample.fds > baseline.fds + fd_slack

    sample = read()
    with trio.move_on_after(timeout):
        while above(sample):
            await trio.sleep(every)
            sample = read()
    await trio.sleep(1.0)
    return time.perf_counter() - began, read()
