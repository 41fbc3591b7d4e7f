"""Logging: JSON or text lines, written off the event loop, and the access log.

Handlers write from a :class:`logging.handlers.QueueListener` thread: a slow
stderr (a full pipe, a stalled journald) must not stall every request. The
access log is a telemetry sink, one line per finished request, with the
facts an SRE greps for and nothing secret: no API key ever, no prompt text
unless ``logging.log_prompts`` is on.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import trio

from tailguard.router.observe import RequestRecord

from .log_format import ACCESS_LOGGER, JsonFormatter, TextFormatter, iso_time

_PROMPT_LOG_LIMIT = 4000  # characters of prompt text in one access line, when enabled


@contextmanager
def configured_logging(level: str, log_format: Literal["json", "text"]) -> Iterator[None]:
    """Route the root logger through a queue to stderr for the process's lifetime."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, handler, respect_handler_level=False)
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    root.handlers = [logging.handlers.QueueHandler(records)]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per backend call is noise
    # A Redis connection that drops logs an INFO traceback there; tailguard.cluster says it once an outage.
    logging.getLogger("coredis").setLevel(logging.WARNING)
    listener.start()
    try:
        yield
    finally:
        listener.stop()
        root.setLevel(saved[0])
        root.handlers = saved[1]


class AccessLog:
    """Telemetry sink: one log line per finished request."""

    def __init__(self, *, log_prompts: bool = False, enabled: bool = True, logger: logging.Logger | None = None) -> None:
        self.log_prompts = log_prompts
        self.enabled = enabled
        self._logger = logger or logging.getLogger(ACCESS_LOGGER)

    def __call__(self, record: RequestRecord) -> None:
        if not self.enabled or not self._logger.isEnabledFor(logging.INFO):
            return
        fields = access_fields(record, log_prompts=self.log_prompts)
        message = f"{fields['api']} {fields['kind']} {fields['status']} {fields['outcome']}"
        self._logger.info(message, extra={"fields": fields})


def access_fields(record: RequestRecord, *, log_prompts: bool = False) -> dict[str, Any]:
    """The access line's fields, in a stable order; times in milliseconds."""
    offset = _wall_offset()
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "api": record.api,
        "kind": record.kind,
        "stream": record.stream,
        "caller": record.caller,
        "tenant": record.caller,  # whose fair share and budgets it counts in: the key's name ("anonymous" without auth)
        "class": record.request_class,
        "pool": record.pool,
        "endpoint": record.endpoint,
        "upstream_id": record.upstream_id,  # vLLM's request id (its logs, its metrics), one per attempt
        "lender": record.lender,
        "placement": record.placement,  # how the endpoint was chosen: home, spilled, no_key, hot_key, borrowed, least_loaded

        "prompt_tokens_est": record.prompt_tokens,  # tailguard's estimate, what caps, classes and budgets used
        "prompt_tokens": record.input_tokens,  # the engine's count (its usage.prompt_tokens); null when it sent none
        "max_tokens_requested": record.requested_max_tokens,
        "max_tokens": record.max_tokens,
        "clamped": record.clamped,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,  # the engine's prefix-cache hit, when its usage says (else null)
        "uncached_tokens": record.uncached_tokens,  # what a prompt_bound = "uncached" class counted (else null)
        "prefix_group": record.prefix_group,  # a digest of its prefix key: equal for a shared prefix or hint (no text)
        "outcome": record.outcome,
        "reason": record.reason,
        "status": record.status,
        "queue_ms": _ms(record.waited_seconds),  # admitted or not: a queue_timeout shows its wait
        # When it got its seat, and when (and for how many tokens) its caller's budget counted it: a budget's
        # 60 s count from there, not from when it was sent. Timestamps as "ts" (JSON) writes its own.
        "admitted_at": _timestamp(record.admitted_at, offset),
        "budget_at": _timestamp(record.budget_at, offset),
        "budget_tokens": record.budget_tokens,
        "ttft_ms": _ms(record.ttft_seconds),
        "decode_ms": _ms(record.decode_seconds),
        "e2e_ms": _ms(record.e2e_seconds),
        "tpot_ms": _ms(record.time_per_output_token),  # decode time per output token after the first (streams)
        "max_gap_ms": _ms(record.max_gap) if record.max_gap else None,  # the longest wait between two relayed chunks
        # The call to the engine's first byte (streams), and what the engine's learnt model predicted for it.
        "first_byte_ms": _ms(record.first_byte_seconds),
        "first_byte_predicted_ms": _ms(record.first_byte_predicted),
        # Seat to end (served whole), and what its class's service time predicted at admission (its queue deadline's share).
        "service_ms": _ms(record.service_seconds),
        "service_predicted_ms": _ms(record.service_predicted),
        # What the engine reported itself (vLLM's --enable-per-request-metrics; null where it sends none).
        "engine_queue_ms": _ms(record.engine_queue),
        "engine_ttft_ms": _ms(record.engine_ttft),
        "engine_itl_ms": _ms(record.engine_itl),
        "objective_met": record.objective_met,  # its class's objective held for it; null: not judged (docs/objectives.md)
    }
    if record.error is not None:
        fields["error"] = record.error
    if log_prompts and record.prompt_text is not None:
        fields["prompt"] = record.prompt_text[:_PROMPT_LOG_LIMIT]
    return fields


def _wall_offset() -> float | None:
    """Wall-clock seconds minus trio's clock now (the record's times are trio's); None outside a trio run."""
    try:
        return time.time() - trio.current_time()
    except RuntimeError:
        return None


def _timestamp(at: float | None, offset: float | None) -> str | None:
    """A trio clock time as the log's own ``ts`` (UTC, milliseconds)."""
    return None if at is None or offset is None else iso_time(at + offset)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
