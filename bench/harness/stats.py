"""The benchmarks' statistics: one percentile definition for every driver and report.

Nearest rank, as the reports have always stated their P50 / P99: the value
of a sample that was measured, never one interpolated between two. The
product's planner and virtual-time replay keep their own
(``tailguard.server.advise.replay.mix.percentile``): what it ships does not depend
on the benchmarks, and a change here must not move a shipped answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of already sorted values; NaN if there are none."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def percentiles(sorted_values: Sequence[float], qs: Sequence[int]) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` for each ``q`` in ``qs`` (the keys the reports' JSON uses)."""
    return {f"p{q}": percentile(sorted_values, q) for q in qs}
