"""Adaptive shedding: refuse a caller's calls at the door while most of its recent ones were refused inside.

The rule is the SRE book's adaptive throttling ("Handling Overload"; Envoy's
admission control filter applies it at a proxy): over a recent window, refuse
a new call with probability ``max(0, (requests - K * accepts) / (requests + 1))``.
With ``K = 2`` about twice a caller's accepted rate still reaches the router,
which keeps finding out whether room came back; the rest are refused before
they cost it anything. Under a flood of calls the router would refuse anyway
(queue full, over a cap) that is the difference between refusing at the rate
the front end picks calls up and refusing at the rate the router can decide.

Two choices differ from the book's client-side version. A call counts as
accepted until it is refused, so a burst of new calls is not shed before the
first of them is answered. And the window slides in steps, so a flood that
has left the window is forgotten at once (decaying counts would keep its
ratio, and keep shedding, until new calls diluted it).

Who a caller is, is the front end's to say, and it must be something the
caller cannot mint per call (an authenticated key's name, a connection): a
raw header value would make each call a caller of its own, never shed.

Wire-free and clock-free: the caller passes ``now``; any thread may own one,
none may share it.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Hashable

# Calls over this window (seconds) decide; it slides in _STEPS steps.
WINDOW_SECONDS = 1.0
_STEPS = 10
# Accepted calls' weight: shedding starts once more than 1 - 1/K of the window's calls were refused.
ACCEPTS_FACTOR = 2.0
# No shedding while the window holds fewer of a caller's calls (Envoy's rps_threshold): few calls are no flood, and their ratio is noise.
MIN_CALLS = 100
# Callers tracked at once; beyond it, callers new to the shed share one tally.
MAX_CALLERS = 10_000
_OVERFLOW = object()


class _History:
    """One caller's calls and refusals in the window's steps: [step number, calls, refused]."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: collections.deque[list[int]] = collections.deque()

    def add(self, step: int, calls: int, refused: int) -> None:
        if self.steps and self.steps[-1][0] == step:
            last = self.steps[-1]
            last[1] += calls
            last[2] += refused
        else:
            self.steps.append([step, calls, refused])

    def forget_before(self, step: int) -> None:
        while self.steps and self.steps[0][0] < step:
            self.steps.popleft()

    def totals(self) -> tuple[int, int]:
        calls = refused = 0
        for _, c, r in self.steps:
            calls += c
            refused += r
        return calls, refused


class AdaptiveShed:
    """Per caller: let a call in, or refuse it at once because its recent calls were mostly refused."""

    def __init__(
        self,
        *,
        window: float = WINDOW_SECONDS,
        accepts_factor: float = ACCEPTS_FACTOR,
        min_calls: int = MIN_CALLS,
        max_callers: int = MAX_CALLERS,
        rng: random.Random | None = None,
    ) -> None:
        self._step = window / _STEPS
        self._accepts_factor = accepts_factor
        self._min_calls = min_calls
        self._max_callers = max_callers
        self._rng = rng or random.Random()
        self._callers: dict[Hashable, _History] = {}

    def admit(self, caller: Hashable, now: float) -> bool:
        """Count a call of ``caller``'s; False: refuse it now (it is counted refused too)."""
        history, step = self._history(caller, now)
        chance = self.shed_chance(history)
        shed = chance > 0.0 and self._rng.random() < chance
        history.add(step, 1, int(shed))
        return not shed

    def refused(self, caller: Hashable, now: float) -> None:
        """A call of ``caller``'s that got in was refused for overload inside (queue full, a cap, no room)."""
        history, step = self._history(caller, now)
        history.add(step, 0, 1)

    def chance(self, caller: Hashable, now: float) -> float:
        """The probability that ``caller``'s next call is shed (for reports and tests)."""
        return self.shed_chance(self._history(caller, now)[0])

    def shed_chance(self, history: _History) -> float:
        calls, refused = history.totals()
        if calls < self._min_calls:
            return 0.0
        accepted = max(0, calls - refused)
        return min(1.0, max(0.0, (calls - self._accepts_factor * accepted) / (calls + 1.0)))

    @property
    def callers(self) -> int:
        """Callers tracked now."""
        return len(self._callers)

    def _history(self, caller: Hashable, now: float) -> tuple[_History, int]:
        step = int(now // self._step)
        oldest = step - _STEPS + 1  # the window: this step and the _STEPS - 1 before it
        history = self._callers.get(caller)
        if history is None:
            if len(self._callers) >= self._max_callers:
                self._forget_quiet(oldest)
            if len(self._callers) >= self._max_callers:
                caller = _OVERFLOW
            history = self._callers.setdefault(caller, _History())
        history.forget_before(oldest)
        return history, step

    def _forget_quiet(self, oldest: int) -> None:
        """Drop the callers with nothing left in the window."""
        quiet = [caller for caller, history in self._callers.items() if not history.steps or history.steps[-1][0] < oldest]
        for caller in quiet:
            del self._callers[caller]
