"""Attainment: the share of each class's requests that met the class's objective, judged as each one ends.

A class's objective (``[classes.NAME.objective]``, router/config/objectives.py)
is what the class is promised; this is how well it is kept, from what the router
itself saw of every request: when its first token came, how fast the rest
followed, when it ended. A request tailguard refused or failed for want of
capacity missed; one refused for what it was (bad input, its caller's own
limits and budgets) or whose caller left on time is not judged: placement
could not have served it better. Kept per class over a sliding window (what
``/metrics`` and ``/v1/limits`` show) and in total.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import ClassConfig, ObjectiveConfig
from .telemetry import RequestRecord

__all__ = ["Attainment", "ClassAttainment", "attainment_document", "judge"]

# Refusals that are the caller's own (its concurrency limit, its token budget), a shutdown, and a caller too slow
# to read: not placement's doing, so not judged.
_NOT_JUDGED = frozenset({"caller_limit", "token_budget", "draining", "caller_stalled"})
WINDOW_S = 60.0  # attainment "now": the requests that ended in the last minute
_MOST_KEPT = 100_000  # a window's verdicts at most (past it the oldest go first: the window is then shorter)


def judge(record: RequestRecord, objective: ObjectiveConfig) -> bool | None:
    """Whether ``record`` (finished) met ``objective``; None when it is not judged (see the module's docstring).

    A caller who left is judged only if the request was already late: no
    first token by ``ttft``, or past ``e2e``.
    """
    outcome = record.outcome
    if outcome == "rejected" or record.reason in _NOT_JUDGED:
        return None
    if outcome == "cancelled":
        took = record.e2e_seconds
        if took is None:
            return None
        no_token_in_time = record.first_token_at is None and objective.ttft is not None and took > objective.ttft
        return False if no_token_in_time or took > objective.e2e else None
    if outcome != "ok":
        return False
    return _in_time(record, objective)


def _in_time(record: RequestRecord, objective: ObjectiveConfig) -> bool:
    """Every stated target held for a request that was served."""
    e2e = record.e2e_seconds
    if e2e is not None and e2e > objective.e2e:
        return False
    if objective.ttft is not None:
        ttft = record.ttft_seconds
        if ttft is None and record.first_token_at is not None:  # a whole answer: its first token is its end
            ttft = record.first_token_at - record.arrival
        if ttft is not None and ttft > objective.ttft:
            return False
    if objective.itl is not None:
        per_token = record.time_per_output_token
        if per_token is not None and per_token > objective.itl:
            return False
    return True


@dataclass(frozen=True)
class ClassAttainment:
    """One class's attainment: over the last ``window_s`` seconds and since the start."""

    name: str
    target: float  # the share that must meet the objective: its percentile / 100
    judged: int  # in the window
    met: int  # in the window
    judged_total: int
    met_total: int
    tokens: int  # output tokens of the window's judged requests
    throughput_share: float | None  # of all classes' window tokens, this class's (None: none generated)

    @property
    def attainment(self) -> float | None:
        """The share of the window's judged requests that met the objective (None: none judged)."""
        return None if not self.judged else self.met / self.judged

    @property
    def on_target(self) -> bool | None:
        attainment = self.attainment
        return None if attainment is None else attainment >= self.target


class _ClassWindow:
    """One class's verdicts: (end time, met, output tokens) of the last window, and running totals."""

    __slots__ = ("judged_total", "met_in_window", "met_total", "tokens_in_window", "verdicts")

    def __init__(self) -> None:
        self.verdicts: deque[tuple[float, bool, int]] = deque()
        self.met_in_window = 0
        self.tokens_in_window = 0
        self.judged_total = 0
        self.met_total = 0

    def add(self, at: float, met: bool, tokens: int) -> None:
        self.verdicts.append((at, met, tokens))
        self.met_in_window += met
        self.tokens_in_window += tokens
        self.judged_total += 1
        self.met_total += met
        if len(self.verdicts) > _MOST_KEPT:
            self._drop_oldest()

    def trim(self, now: float) -> None:
        verdicts = self.verdicts
        while verdicts and verdicts[0][0] < now - WINDOW_S:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, met, tokens = self.verdicts.popleft()
        self.met_in_window -= met
        self.tokens_in_window -= tokens


class Attainment:
    """Each class's verdicts, kept as requests end (:meth:`observe` is a telemetry sink)."""

    def __init__(self) -> None:
        self._classes: dict[str, _ClassWindow] = {}

    def observe(self, record: RequestRecord, klass: ClassConfig | None) -> None:
        """Judge a finished request of ``klass`` (None: it was refused before it had a class) and keep the verdict on it."""
        if klass is None:
            return
        met = judge(record, klass.objective)
        record.objective_met = met
        if met is None:
            return
        window = self._classes.get(klass.name)
        if window is None:
            window = self._classes[klass.name] = _ClassWindow()
        at = record.finished_at if record.finished_at is not None else record.arrival
        window.trim(at)
        window.add(at, met, record.completion_tokens or 0)

    def view(self, classes: Iterable[ClassConfig], now: float | None) -> tuple[ClassAttainment, ...]:
        """Every class of ``classes`` (the config's: a class a reload removed is no longer shown), as of ``now``
        (None: as the last verdict left the windows)."""
        if now is not None:
            for window in self._classes.values():
                window.trim(now)
        all_tokens = sum(window.tokens_in_window for window in self._classes.values())
        shown = []
        for klass in classes:
            window = self._classes.get(klass.name) or _ClassWindow()
            share = window.tokens_in_window / all_tokens if all_tokens else None
            shown.append(
                ClassAttainment(
                    klass.name,
                    klass.objective.percentile / 100,
                    len(window.verdicts),
                    window.met_in_window,
                    window.judged_total,
                    window.met_total,
                    window.tokens_in_window,
                    share,
                )
            )
        return tuple(shown)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the classes not in ``keep`` (a reload removed them)."""
        kept = set(keep)
        for name in [name for name in self._classes if name not in kept]:
            del self._classes[name]


def attainment_document(view: Iterable[ClassAttainment]) -> dict[str, dict[str, object]]:
    """``view`` as ``GET /v1/limits`` shows it: per class, the last minute's share met, its target, and the totals."""
    return {
        shown.name: {
            "window_s": WINDOW_S,
            "judged": shown.judged,
            "met": shown.met,
            "attainment": shown.attainment,
            "target": shown.target,
            "on_target": shown.on_target,
            "judged_total": shown.judged_total,
            "met_total": shown.met_total,
            "tokens": shown.tokens,
            "throughput_share": shown.throughput_share,
        }
        for shown in view
    }
