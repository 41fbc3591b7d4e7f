"""A replay's requests written as tailguard's JSON access lines, so ``tailguard advise --access-log`` can read a trace.

Each line is formatted by the server's own ``JsonFormatter`` under the
``tailguard.access`` logger with the fields ``server.logs.access_fields``
names, as tailguard writes them: ``ts`` when the request ended, ``e2e_ms``,
``ttft_ms``, the class the running config gave it, the estimated prompt and
``max_tokens``. What a replay did not record (caller, endpoint, prefix group:
these lines carry no prefix information, so advise replays every prompt
unique) is null. advise reads an arrival back as ``ts`` less ``e2e_ms``: to
the millisecond ``ts`` is written in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from tailguard.server.logs import ACCESS_LOGGER, JsonFormatter
from tailguard.sim.virtual.fleet import Arrival, Record

EPOCH = 1_735_689_600.0  # 2025-01-01T00:00:00Z: the replay's time zero on the log's clock


def access_line(arrival: Arrival, record: Record | None, short_class: str, long_class: str, start: float = EPOCH) -> str:
    """One request's access line; ``record`` (its fate in a replay) gives its times and outcome, else it ended on arrival."""
    ok = record is None or record.outcome == "ok"
    e2e = (record.e2e if record is not None else None) or 0.0
    ttft = record.ttft if record is not None else None
    fields = {
        "request_id": f"r{arrival.index}",
        "api": "http",
        "kind": "chat",
        "stream": True,
        "caller": None,
        "class": short_class if arrival.kind == "short" else long_class,
        "prompt_tokens_est": arrival.prompt_tokens,
        "max_tokens_requested": arrival.max_tokens,
        "max_tokens": arrival.max_tokens,
        "completion_tokens": arrival.max_tokens if ok else None,
        "cached_tokens": None,
        "prefix_group": None,
        "outcome": "ok" if ok else "error",
        "reason": None if ok or record is None else record.outcome,
        "status": 200 if ok else 503,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "e2e_ms": round(e2e * 1000, 1),
    }
    line = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "http chat", None, None)
    line.created = start + arrival.at + e2e
    line.fields = fields
    return JsonFormatter().format(line)


def write_log(path: Path, arrivals: Sequence[Arrival], records: Iterable[Record] | None, short_class: str, long_class: str) -> int:
    """Write one access line per arrival (in the order requests ended, as a log has them); the lines written.

    ``records`` are the replay's, one per arrival in its order (None: no replay, every request ended on arrival).
    """
    fates: list[Record | None] = list(records) if records is not None else [None] * len(arrivals)
    if len(fates) != len(arrivals):
        raise ValueError(f"{len(fates)} records for {len(arrivals)} arrivals")
    lines = [
        (a.at + ((r.e2e or 0.0) if r is not None else 0.0), access_line(a, r, short_class, long_class)) for a, r in zip(arrivals, fates)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(text + "\n" for _, text in sorted(lines, key=lambda row: row[0])))
    return len(lines)
