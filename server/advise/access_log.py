"""tailguard's JSON access log as advise reads it, and a replay's requests written as one.

Read (``read_access_log``): every access line's arrival (its ``ts`` less
its ``e2e_ms``), shape and prefix fields, and what the log held besides, so
advice says how much of the log it rests on (``LogUsage``: lines and seconds
of arrivals used, of how many). Written (``write_log``): a
replay's requests as tailguard's own ``JsonFormatter`` writes them under the
``tailguard.access`` logger, with the fields ``server.logs.access_fields``
names (``ts`` when the request ended, ``e2e_ms``, ``ttft_ms``, the class the
running config gave it, the estimated prompt and ``max_tokens``), so
``tailguard advise --access-log`` can read a trace. What a replay did not
record (caller, endpoint, prefix group: these lines carry no prefix
information, so advise replays every prompt unique) is null. ``ts`` is to
the millisecond, and so is an arrival read back.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailguard.server.log_format import ACCESS_LOGGER, JsonFormatter, read_iso_time

from .prefixes import Seen, seen_in
from .replay.fleet import Arrival, Record
from .replay.trace import MAX_ARRIVALS

# Why an access log's line was not replayed, in the order the summary lists them.
NOT_JSON = "not JSON"
NOT_ACCESS = "not an access line"
REJECTED = "an error outcome no split would serve (rejected: the caller's mistake)"
NO_SIZE = "no prompt estimate or max_tokens (refused before they were read)"
BAD_TIME = "an unparseable time (ts or e2e_ms)"
OUTSIDE = "after the replayed window (--seconds, or advise's maximum, from the first arrival)"
OVER_MAX = f"past the replay's {MAX_ARRIVALS} requests"
_WHY_ORDER = (NOT_JSON, NOT_ACCESS, REJECTED, NO_SIZE, BAD_TIME, OUTSIDE, OVER_MAX)


@dataclass(frozen=True)
class LogUsage:
    """How much of an access log (or a trace) was replayed, and why the rest was not: advice resting on a
    tenth of the log, or on none of the short requests, must say so.

    ``skipped`` is (why, lines, detail) for each reason that skipped any, in
    ``_WHY_ORDER``; the detail of the error outcomes is their reasons and counts.
    ``span`` is the seconds of arrivals replayed (first to last), ``whole``
    those of every line with a time, so a cut window reads as one.
    """

    lines: int  # read (blank ones not counted)
    used: int
    skipped: tuple[tuple[str, int, str], ...]
    span: float = 0.0
    whole: float = 0.0
    noun: str = "lines"  # what ``lines`` counts: an access log's lines, a trace's rows

    @property
    def cut(self) -> bool:
        """Lines that would have been replayed were left past the window or the request bound."""
        return any(why in (OUTSIDE, OVER_MAX) for why, _, _ in self.skipped)

    def summary(self, source: str) -> str:
        seconds = f"{_seconds(self.span)} of {_seconds(self.whole)} s" if self.cut else f"{_seconds(self.span)} s"
        head = f"{source}: used {self.used:,} of {self.lines:,} {self.noun}, {seconds} of arrivals"
        if not self.skipped:
            return head + ", none skipped"
        parts = [f"{n:,} {why}" + (f" [{detail}]" if detail else "") for why, n, detail in self.skipped]
        return f"{head}; {sum(n for _, n, _ in self.skipped):,} skipped: " + "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "used": self.used,
            "span_s": self.span,
            "whole_s": self.whole,
            "skipped": [{"why": why, "lines": n, "detail": d} for why, n, d in self.skipped],
        }


def _seconds(value: float) -> str:
    """Whole seconds with thousands separators; a tenth where that is all there is (a trace of GPU seconds)."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def read_access_log(path: Path, short_class: str, seconds: float = math.inf) -> tuple[list[Arrival], list[Seen], LogUsage]:
    """tailguard's JSON access lines: each request's arrival (its line's time less its E2E), shape and
    prefix (its ``prefix_group`` and ``cached_tokens``), and what the log held besides.

    Replayed: every access line with its size, whatever its outcome but
    ``rejected`` (a request refused for being busy, slow or failed upstream is
    demand a better split may serve; a malformed or unauthorized one is not).
    A request is short when its class was ``short_class``. Time starts at the
    first arrival; ``seconds`` of arrivals are kept (default: all of them), at
    most ``MAX_ARRIVALS``.
    """
    found: list[tuple[float, str, int, int, Seen]] = []
    skipped: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {}
    lines = 0

    def skip(why: str, reason: object = None) -> None:
        skipped[why] = skipped.get(why, 0) + 1
        if reason is not None:
            by = reasons.setdefault(why, {})
            by[str(reason)] = by.get(str(reason), 0) + 1

    with path.open(encoding="utf-8", errors="replace") as text:
        for line in text:
            if not line.strip():
                continue
            lines += 1
            try:
                row = json.loads(line)
            except ValueError:
                skip(NOT_JSON)
                continue
            if not isinstance(row, dict):
                skip(NOT_JSON)
                continue
            if row.get("logger") != ACCESS_LOGGER:
                skip(NOT_ACCESS)
                continue
            if row.get("outcome") == "rejected":
                skip(REJECTED, row.get("reason") or "no reason")
                continue
            prompt, max_tokens, stamp = row.get("prompt_tokens_est"), row.get("max_tokens"), row.get("ts")
            if not (isinstance(prompt, int) and isinstance(max_tokens, int)) or prompt < 1 or max_tokens < 1:
                skip(NO_SIZE, row.get("reason") or row.get("outcome") or None)
                continue
            try:
                if not isinstance(stamp, str):
                    raise ValueError(stamp)
                at = read_iso_time(stamp) - float(row.get("e2e_ms") or 0.0) / 1000
            except (ValueError, TypeError):
                skip(BAD_TIME)
                continue
            found.append((at, "short" if row.get("class") == short_class else "long", prompt, max_tokens, seen_in(row)))
    found.sort(key=lambda row: row[:4])  # by time, then shape, as ever
    origin = found[0][0] if found else 0.0
    window = [row for row in found if row[0] - origin < seconds]
    kept = window[:MAX_ARRIVALS]
    skipped[OUTSIDE], skipped[OVER_MAX] = len(found) - len(window), len(window) - len(kept)
    arrivals = [Arrival(i, at - origin, kind, True, prompt, out) for i, (at, kind, prompt, out, _) in enumerate(kept)]
    details = {why: ", ".join(f"{reason} {n}" for reason, n in sorted(by.items(), key=lambda item: (-item[1], item[0]))) for why, by in reasons.items()}
    whole, span = (found[-1][0] - origin if found else 0.0), (kept[-1][0] - origin if kept else 0.0)
    why = tuple((why, skipped[why], details.get(why, "")) for why in _WHY_ORDER if skipped.get(why))
    usage = LogUsage(lines, len(kept), why, span, whole)
    return arrivals, [row[4] for row in kept], usage


def arrivals_from_access_log(path: Path, short_class: str, seconds: float = math.inf) -> list[Arrival]:
    """``read_access_log``'s arrivals alone."""
    return read_access_log(path, short_class, seconds)[0]


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
