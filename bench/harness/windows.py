"""The budget benchmark's arithmetic: tokens admitted in sliding minutes, in bins, per phase, and the target's verdict.

Pure functions of (time, tokens) events, so the test checks them on
synthetic data without a clock. A token budget is "any 60 s admits at most
the budget": the fleet-wide figure is the most tokens whose requests were
sent within one 60 s window, wherever the window lies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

WINDOW_S = 60.0  # a token budget's "minute" (router.budgets.WINDOW)

Event = tuple[float, int]  # (s from the run's origin, tokens)


@dataclass(frozen=True)
class WindowMax:
    """The most tokens in one window ``[start, start + WINDOW_S)``."""

    tokens: int
    start: float


def sliding_max(events: Iterable[Event], window: float = WINDOW_S) -> WindowMax:
    """The most tokens in any ``[t, t + window)``, over every real t: exact.

    A window holding the most can be slid right until it starts at its first
    event without losing any, so only windows starting at an event need a
    look (two pointers over the events in time order).
    """
    ordered = sorted(events)
    best = WindowMax(0, 0.0)
    total, end = 0, 0
    for begin, (start, tokens) in enumerate(ordered):
        while end < len(ordered) and ordered[end][0] < start + window:
            total += ordered[end][1]
            end += 1
        if total > best.tokens:
            best = WindowMax(total, start)
        total -= tokens
        assert end > begin  # the window holds its own first event
    return best


def stepped_sums(events: Iterable[Event], until: float, window: float = WINDOW_S, step: float = 1.0) -> list[tuple[float, int]]:
    """(t, tokens in ``[t - window, t)``) for t = step, 2 step, ... up to the first at or past ``until`` + window.

    The trailing minute at every step: the windows sampled on a grid (what
    ``sliding_max`` bounds from above), for the report's timeline.
    """
    ordered = sorted(events)
    out: list[tuple[float, int]] = []
    total, head, tail = 0, 0, 0
    for k in range(1, math.ceil((until + window) / step) + 1):
        t = k * step
        while head < len(ordered) and ordered[head][0] < t:
            total += ordered[head][1]
            head += 1
        while tail < head and ordered[tail][0] < t - window:
            total -= ordered[tail][1]
            tail += 1
        out.append((t, total))
    return out


def binned(events: Iterable[Event], width: float, until: float) -> list[int]:
    """Tokens per ``[k width, (k + 1) width)`` for the bins that start before ``until`` (later events are left out)."""
    bins = [0] * max(math.ceil(until / width), 0)
    for at, tokens in events:
        k = int(at // width)
        if 0 <= k < len(bins):
            bins[k] += tokens
    return bins


def per_minute(events: Iterable[Event], start: float, end: float) -> float:
    """Tokens sent in ``[start, end)``, as a rate per 60 s (NaN for an empty span)."""
    if end <= start:
        return math.nan
    return sum(tokens for at, tokens in events if start <= at < end) * WINDOW_S / (end - start)


def static_share_rate(offered: Sequence[float], share: float, budget: int) -> float:
    """Tokens a minute the static-share rule admits at most, each replica offered ``offered[i]`` a minute.

    Each replica alone within ``share`` of the budget: what a fleet that never
    trades its shares gets under this spread (a steady-state figure: a
    sliding window carries a minute's history across a phase's start).
    """
    return sum(min(rate, share * budget) for rate in offered)


def within_target(most: int, budget: int, largest: int) -> bool:
    """The target: no minute admits more than the budget and one largest request."""
    return most <= budget + largest
