"""What "better" means between set-ups whose interactive classes differ: one rule, for predictions and for sweeps.

Per-class P99 ratios are not comparable as they stand once the thresholds
differ: a set-up that calls only the tiniest requests short reports a
splendid short P99 of different requests. So every set-up is judged on the
same two request sets, the classes the log itself recorded (the requests the
running config called interactive, and the rest), and against the same
baseline, round robin over every engine with no router, on the same
arrivals. Those recorded classes are whom the operator set out to protect; a
new threshold is a means of serving them, not a new yardstick. It is also
the yardstick of issue 23's targets and of ``python -m bench trace``'s
ratios, so advise's pick and a sweep's best are compared like for like.
Where the log has no short request (Mooncake by the shipped thresholds),
only the long figures, i.e. every request, decide.

The rule: a set-up is *safe* when it is no worse than round robin, as the
issue's targets put it (long E2E P99 <= 1.1x, short E2E P99 <= 1.1x,
completed/s >= 0.97x, no failure beyond round robin's). Among safe ones the
lowest short E2E P99 wins (no short requests: the lowest long E2E P99), then
the lowest long E2E P99 (ratios equal to two decimals tie), then the fewer
settings. If none is safe, the one
that misses the bounds by the least. advise holds its predictions to
``PREDICTED_E2E_MAX`` (1.05x) instead of 1.1x: half the slack is left for
what a replay of part of the log gets wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

E2E_MAX = 1.1  # each class's E2E P99 at most this times round robin's
# What a prediction must clear: advise replays a window of the log, and a
# figure near the bound lands either side of it on the whole traffic (ShareGPT,
# 4 engines: 1.09x predicted, 1.23x swept; bench/results/trace/advise-no-headroom/).
PREDICTED_E2E_MAX = 1.05
COMPLETED_MIN = 0.97  # completed/s at least this times round robin's
WITHIN = 1.1  # "within 10%" of the best: each class's E2E P99 at most this times the best's


@dataclass(frozen=True)
class Figures:
    """A set-up against round robin on the same arrivals and the log's own classes (ratios; NaN: no such requests)."""

    long_e2e: float  # long E2E P99 x round robin's
    short_e2e: float
    short_ttft: float
    completed: float  # completed/s x round robin's
    failures_beyond: int  # failed requests beyond round robin's
    settings: int = 0  # how much it changes (ties go to the simpler one)

    @property
    def safe(self) -> bool:
        return self.safe_at(E2E_MAX)

    def safe_at(self, e2e_max: float) -> bool:
        """No worse than round robin, each class's E2E P99 at most ``e2e_max`` x its."""
        shorts_ok = math.isnan(self.short_e2e) or self.short_e2e <= e2e_max
        return self.long_e2e <= e2e_max and shorts_ok and self.completed >= COMPLETED_MIN and self.failures_beyond == 0

    def miss(self, e2e_max: float = E2E_MAX) -> float:
        """How far outside the bounds (<= 1: inside), failures counting one each."""
        over = [self.long_e2e / e2e_max, COMPLETED_MIN / self.completed if self.completed > 0 else math.inf]
        over += [] if math.isnan(self.short_e2e) else [self.short_e2e / e2e_max]
        return max(over) + self.failures_beyond

    def key(self) -> tuple[float, float, int]:
        """Ratios equal to the report's two decimals tie (then the fewer settings win)."""
        first = self.long_e2e if math.isnan(self.short_e2e) else self.short_e2e
        return round(first, 2), round(self.long_e2e, 2), self.settings


def best(figures: Sequence[Figures], e2e_max: float = E2E_MAX) -> tuple[int, bool]:
    """The index of the best of ``figures`` by the rule above (safe: E2E P99s at most ``e2e_max`` x), and whether it is safe."""
    if not figures:
        raise ValueError("nothing to judge")
    safe = [i for i, f in enumerate(figures) if f.safe_at(e2e_max)]
    if safe:
        return min(safe, key=lambda i: figures[i].key()), True
    return min(range(len(figures)), key=lambda i: (figures[i].miss(e2e_max), figures[i].key())), False


def within(pick: Figures, top: Figures) -> bool:
    """The pick's long and short E2E P99 each within ``WITHIN`` x the best's (short: where both have shorts)."""
    long_ok = pick.long_e2e <= WITHIN * top.long_e2e
    short_ok = math.isnan(pick.short_e2e) or math.isnan(top.short_e2e) or pick.short_e2e <= WITHIN * top.short_e2e
    return long_ok and short_ok
