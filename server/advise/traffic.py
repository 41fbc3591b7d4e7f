"""The traffic advise replays: a recorded trace's arrivals (and their prefix fields), fitted to what the router would take.

An access log is read by ``access_log``; either way the arrivals are
clamped and dropped here as the router's caps would (``fit``). A trace read
whole or in part (``read_trace_window``) says how much of it was used, as an
access log does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from tailguard.router.config import Config

from .access_log import OUTSIDE, OVER_MAX, LogUsage
from .prefixes import Seen, seen_in
from .replay.fleet import Arrival
from .replay.trace import MAX_ARRIVALS, read_trace


def arrivals_from_trace(path: Path, seconds: float = math.inf) -> list[Arrival]:
    """A ``bench tail --record-trace`` file (GPU seconds), its first ``seconds`` of arrivals."""
    rows = read_trace(path, 1.0, 0.0, seconds)
    return [Arrival(i, a.at, a.kind, True, a.prompt, a.max_tokens) for i, a in enumerate(rows)]


def seen_in_trace(path: Path, seconds: float = math.inf) -> list[Seen]:
    """A trace's prefix fields (``prefix_group``, ``cached_tokens``) where its rows carry them, one per arrival
    of ``arrivals_from_trace`` and in its order (the rows it keeps, stably sorted by time)."""
    rows: list[tuple[float, Seen]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if float(row["at"]) >= seconds or len(rows) >= MAX_ARRIVALS:
            break
        rows.append((float(row["at"]), seen_in(row)))
    return [seen for _, seen in sorted(rows, key=lambda r: r[0])]


def read_trace_window(path: Path, seconds: float = math.inf) -> tuple[list[Arrival], list[Seen], LogUsage]:
    """A trace's first ``seconds`` of arrivals (default: all, at most ``MAX_ARRIVALS``), their prefix fields, and
    how much of the trace they are (rows, GPU seconds), so advice on a tenth of a trace says so.

    Raises ValueError naming the line of a row without a readable ``at`` (or, within the window, size).
    """
    arrivals, seen = arrivals_from_trace(path, seconds), seen_in_trace(path, seconds)
    times: list[float] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            times.append(float(json.loads(line)["at"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: {error!r}") from None
    window = next((i for i, at in enumerate(times) if at >= seconds), len(times))  # as read_trace stops
    skipped = ((OUTSIDE, len(times) - window, ""), (OVER_MAX, window - len(arrivals), ""))
    span = arrivals[-1].at if arrivals else 0.0
    usage = LogUsage(len(times), len(arrivals), tuple(row for row in skipped if row[1]), span, max(times, default=0.0), "trace rows")
    return arrivals, seen, usage


def fit(arrivals: Sequence[Arrival], config: Config) -> tuple[list[Arrival], list[int]]:
    """The arrivals the router would take, max_tokens clamped as it would; and their places in ``arrivals``.

    Dropped: prompts over the input cap (with a margin for the router's own
    estimate of the replayed text), max_tokens over the output cap in reject
    mode, or more than the pools' context.
    """
    limits = config.limits
    context = min(pool.max_model_len for pool in config.pools)
    kept: list[Arrival] = []
    places: list[int] = []
    for place, a in enumerate(arrivals):
        prompt, out = a.prompt_tokens or 0, a.max_tokens or 0
        if out > limits.output_cap_tokens:
            if limits.over_cap == "reject":
                continue
            out = limits.output_cap_tokens
        if prompt + 16 > limits.input_cap_tokens or prompt + out > context or prompt < 8:
            continue
        kept.append(dataclasses.replace(a, index=len(kept), measured=True, prompt_tokens=prompt, max_tokens=out))
        places.append(place)
    return kept, places
