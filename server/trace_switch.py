"""Which tracer traces new requests, as ``[tracing]`` says now; reloads switch it live.

The OpenTelemetry SDK is imported the first time ``[tracing]`` is enabled,
never before: with tracing off (the default) the process does not load it,
and a request pays one call that returns None. Enabled, it needs the OTLP
exporter, the ``tracing`` extra: without it a start fails and a reload is
refused (a :exc:`ConfigError` naming ``pip install 'tailguard[tracing]'``).

A reload that changes ``[tracing]`` starts a new tracer for the requests that
arrive from then on; the old one keeps the spans of the requests still in
flight and is shut down (its last spans exported) once none of them can be:
after ``timeouts.end_to_end_timeout``. At the process's end every tracer is
shut down, which exports what is left (at most the exporter's timeout, 10 s,
when the collector does not answer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from tailguard.router.config import TracingConfig

if TYPE_CHECKING:
    from tailguard.router.observe.tracing import Tracing

__all__ = ["TracingSwitch"]

log = logging.getLogger("tailguard.tracing")


class TracingSwitch:
    """The tracer in force (call it: None while tracing is off); run :meth:`run` in the process's nursery."""

    def __init__(self, config: TracingConfig, *, grace: Callable[[], float]) -> None:
        self.config = config
        self._grace = grace
        self._current = _start(config)
        self._retired: list[tuple[float, Tracing]] = []  # (when to shut it down, tracer), oldest first
        self._wake = trio.Event()

    def __call__(self) -> Tracing | None:
        return self._current

    def apply(self, config: TracingConfig) -> None:
        """Trace new requests as ``config`` says (a new tracer if any key changed).

        Raises ConfigError, changing nothing, if ``config`` enables tracing without the exporter installed.
        """
        if config == self.config:
            return
        old, self._current = self._current, _start(config)
        self.config = config
        if old is not None:
            self._retired.append((trio.current_time() + self._grace(), old))
            self._wake.set()
        if self._current is None:
            log.info("tracing is off")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Shut retired tracers down when their requests are over; all of them when cancelled."""
        task_status.started()
        try:
            while True:
                if not self._retired:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                due, tracing = self._retired[0]
                await trio.sleep_until(due)
                self._retired.pop(0)
                await trio.to_thread.run_sync(tracing.shutdown)
        finally:
            with trio.CancelScope(shield=True):
                for tracing in [*(t for _, t in self._retired), *([self._current] if self._current is not None else [])]:
                    await trio.to_thread.run_sync(tracing.shutdown)
                self._retired.clear()
                self._current = None


def _start(config: TracingConfig) -> Tracing | None:
    if not config.enabled:
        return None
    from tailguard.router.observe.tracing import Tracing

    log.info(
        "tracing: spans of every request go to %s over OTLP/HTTP (service %s, sample ratio %g)",
        config.endpoint, config.service_name, config.sample_ratio,
    )
    return Tracing(config)
