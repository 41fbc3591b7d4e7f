"""The ``server-timing`` value (HTTP header, gRPC trailing metadata) for one request.

Browsers' dev tools and curl -v show it as is: where the request's time went
-- the router's queue, the first token, the whole -- without a dashboard.
"""

from __future__ import annotations

import trio

from tailguard.router.observe import RequestRecord


def server_timing(record: RequestRecord, *, total: bool) -> str:
    """``queue;dur=…, ttft;dur=…, total;dur=…`` in milliseconds, for the facts known now."""
    parts = []
    if record.queue_seconds is not None:
        parts.append(f"queue;dur={record.queue_seconds * 1000:.1f}")
    if record.ttft_seconds is not None:
        parts.append(f"ttft;dur={record.ttft_seconds * 1000:.1f}")
    if total:
        parts.append(f"total;dur={(trio.current_time() - record.arrival) * 1000:.1f}")
    return ", ".join(parts)
