"""Figures the issue-32 rows compute from what the client saw: latency summaries, tokens served, refusal spells, hints.

Pure functions over answers and replies, so a test checks them without a lab.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from bench.chaos.client import Reply, sse_data
from tailguard.server.advise.replay.mix import percentile


def p50_p99_max_ms(seconds: Sequence[float]) -> list[float]:
    """[P50, P99, max] of durations in seconds, in ms (empty when there are none)."""
    ordered = sorted(s * 1000 for s in seconds)
    if not ordered:
        return []
    return [round(percentile(ordered, 50), 1), round(percentile(ordered, 99), 1), round(ordered[-1], 1)]


def usage_tokens(reply: Reply, stream: bool) -> int:
    """``usage.total_tokens`` of a 200 answer (a stream's usage event, sent with ``include_usage``); 0 when it has none."""
    if reply.status != 200:
        return 0
    bodies = sse_data(reply.body) if stream else [reply.body]
    for body in reversed(bodies):
        try:
            usage = json.loads(body).get("usage")
        except (ValueError, AttributeError):
            continue
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            return int(usage["total_tokens"])
    return 0


@dataclass(frozen=True)
class Spell:
    """A run of one key's refusals: when the first was sent, its Retry-After, and how long until a request of the key got through."""

    start: float
    hint_s: float | None
    lasted_s: float | None  # None: nothing got through after it


def refusal_spells(requests: Sequence[tuple[float, bool, float | None]]) -> list[Spell]:
    """Spells of refusals among one key's requests: (sent at, refused, Retry-After) each, any order."""
    spells: list[Spell] = []
    open_at: tuple[float, float | None] | None = None
    for sent, refused, hint in sorted(requests, key=lambda r: r[0]):
        if refused and open_at is None:
            open_at = (sent, hint)
        elif not refused and open_at is not None:
            spells.append(Spell(open_at[0], open_at[1], sent - open_at[0]))
            open_at = None
    if open_at is not None:
        spells.append(Spell(open_at[0], open_at[1], None))
    return spells


def retry_after(reply: Reply) -> float | None:
    """An answer's Retry-After, in seconds (None without one, or one that is not a number)."""
    try:
        return float(reply.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def queue_seconds(reply: Reply) -> float:
    """The ``queue;dur=`` of tailguard's Server-Timing header, in seconds (0 without one)."""
    for part in reply.headers.get("server-timing", "").split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == "queue":
            try:
                return float(duration) / 1000
            except ValueError:
                return 0.0
    return 0.0
