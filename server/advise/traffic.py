"""The traffic advise replays: a recorded trace's arrivals (and their prefix fields), fitted to what the router would take.

An access log is read by ``access_log``; either way the arrivals are
clamped and dropped here as the router's caps would (``fit``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from tailguard.router.config import Config

from .prefixes import Seen, seen_in
from .replay.fleet import Arrival
from .replay.trace import MAX_ARRIVALS, read_trace


def arrivals_from_trace(path: Path, seconds: float) -> list[Arrival]:
    """A ``bench tail --record-trace`` file (GPU seconds), its first ``seconds`` of arrivals."""
    rows = read_trace(path, 1.0, 0.0, seconds)
    return [Arrival(i, a.at, a.kind, True, a.prompt, a.max_tokens) for i, a in enumerate(rows)]


def seen_in_trace(path: Path, seconds: float) -> list[Seen]:
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
