"""Per-key token and request budgets: reserved at admission, settled at the end, over a sliding minute.

An unbounded ``max_tokens`` gives a caller an unlimited compute quota, and a
per-key concurrency cap bounds requests, not the GPU time they take. A key
with ``tokens_per_minute`` reserves, when it is admitted, what a request may
cost (its estimated prompt tokens and its effective max_tokens) and settles
at its end to what it cost (the backend's usage, or its streamed events),
handing the rest back; a request that got no seat costs nothing.
``requests_per_minute`` counts the requests the same way.

The window slides: what was admitted in the last 60 s, each request counted
at its admission time, must hold the new one. So no 60 s ever admits more
than the budget (a fixed window lets a burst at its end and another at the
next one's start through together), and the Retry-After of a refusal is
exact: when enough of the window's oldest requests leave it. A request
larger than the whole budget could never be admitted: it is a 400 that
names the budget, not a 429 to retry.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Config
from ..errors import BudgetExceeded, InvalidRequest
from .auth import ANONYMOUS, Caller

__all__ = ["WINDOW", "Budgets", "Grant", "RateLimits", "budget_name", "budgets_of", "check_whole", "whole_budgets"]

WINDOW = 60.0  # seconds: "per minute"


@dataclass(frozen=True)
class RateLimits:
    """A budget's state after an admission, as OpenAI's ``x-ratelimit-*`` headers tell it (None: that budget is not set)."""

    limit_requests: int | None
    remaining_requests: int
    reset_requests: float  # seconds until the window holds no request of the key
    limit_tokens: int | None
    remaining_tokens: int
    reset_tokens: float  # seconds until the window holds none of the key's tokens

    def headers(self) -> tuple[tuple[str, str], ...]:
        """OpenAI's six headers, for the budgets that are set."""
        pairs: list[tuple[str, str]] = []
        if self.limit_requests is not None:
            pairs += [
                ("x-ratelimit-limit-requests", str(self.limit_requests)),
                ("x-ratelimit-remaining-requests", str(self.remaining_requests)),
                ("x-ratelimit-reset-requests", duration(self.reset_requests)),
            ]
        if self.limit_tokens is not None:
            pairs += [
                ("x-ratelimit-limit-tokens", str(self.limit_tokens)),
                ("x-ratelimit-remaining-tokens", str(self.remaining_tokens)),
                ("x-ratelimit-reset-tokens", duration(self.reset_tokens)),
            ]
        return tuple(pairs)


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60.0)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


class _Admitted:
    """One admission in a key's window: when, and what it counts for now."""

    __slots__ = ("at", "counted", "requests", "settled", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens
        self.requests = 1
        self.counted = True  # still in the window's sums (not yet a minute old)
        self.settled = False


class _Window:
    """A key's admissions of the last minute, oldest first, and their sums."""

    __slots__ = ("admitted", "requests", "tokens")

    def __init__(self) -> None:
        self.admitted: deque[_Admitted] = deque()
        self.tokens = 0
        self.requests = 0

    def expire(self, now: float) -> None:
        while self.admitted and self.admitted[0].at <= now - WINDOW:
            gone = self.admitted.popleft()
            self.tokens -= gone.tokens
            self.requests -= gone.requests
            gone.counted = False

    def wait_for(self, over: int, count: str, now: float) -> float:
        """Seconds until the oldest admissions leave with at least ``over`` of their ``count`` ("tokens" or "requests")."""
        freed = 0
        for entry in self.admitted:
            freed += getattr(entry, count)
            if freed >= over:
                return entry.at + WINDOW - now
        return WINDOW  # not reached: the caller checked the cost fits the whole budget

    def reset_in(self, count: str, now: float) -> float:
        """Seconds until none of the window's ``count`` is left in it."""
        last = next((e for e in reversed(self.admitted) if getattr(e, count)), None)
        return 0.0 if last is None else last.at + WINDOW - now


_NO_WINDOW = _Window()  # what a caller with no window reads: never admitted to (only Budgets.admit appends, to a kept one)


class Grant:
    """One admitted request's reservation; :meth:`settle` once, at its end."""

    __slots__ = ("_entry", "_window", "limits", "settled")

    def __init__(self, window: _Window, entry: _Admitted, limits: RateLimits) -> None:
        self._window = window
        self._entry = entry
        self.limits = limits
        self.settled: Callable[[], None] | None = None  # told after the settlement (the ledger hears the key's new use)

    @property
    def at(self) -> float:
        """When it was counted in the window (``trio.current_time()``): the time the 60 s are counted from."""
        return self._entry.at

    @property
    def tokens(self) -> int:
        """What it counts for in the window now: its reservation, or once settled what it cost."""
        return self._entry.tokens

    def settle(self, tokens: int, *, served: bool) -> None:
        """What the request cost: ``tokens``, or nothing at all when it was never served (no seat, refused)."""
        entry, window = self._entry, self._window
        if entry.settled:
            return
        entry.settled = True
        cost, requests = (max(0, tokens), 1) if served else (0, 0)
        if entry.counted:  # still in the window: its sums change with it
            window.tokens += cost - entry.tokens
            window.requests += requests - entry.requests
        entry.tokens, entry.requests = cost, requests
        if self.settled is not None:
            self.settled()


def _limits(
    window: _Window, tokens_per_minute: int | None, requests_per_minute: int | None, now: float, elsewhere: tuple[int, int] = (0, 0)
) -> RateLimits:
    return RateLimits(
        requests_per_minute,
        max(0, (requests_per_minute or 0) - window.requests - elsewhere[1]),
        window.reset_in("requests", now),
        tokens_per_minute,
        max(0, (tokens_per_minute or 0) - window.tokens - elsewhere[0]),
        window.reset_in("tokens", now),
    )


def check_whole(tokens: int, tokens_per_minute: int | None, whole: str = "the key's whole budget") -> None:
    """A request alone over the whole token budget could never be admitted: a 400 that names the budget.

    Raises:
      InvalidRequest: it is.
    """
    if tokens_per_minute is not None and tokens > tokens_per_minute:
        raise InvalidRequest(
            f"this request may take {tokens} tokens (its prompt, and max_tokens for each of its n choices), more than {whole} of "
            f"{tokens_per_minute} tokens a minute (tokens_per_minute); lower max_tokens or shorten the prompt",
            param="max_tokens",
        )


class Budgets:
    """Every budgeted key's window, by caller name: only those that admitted a request in the last minute.

    An empty window says no more than no window does, so reading one never
    makes one and :meth:`forget` drops those that emptied: what is kept
    follows the keys in use, not every key ever seen. A :class:`Grant` holds
    its own window, so a request admitted before its window was dropped
    still settles (into a window no longer counted, as a minute-old one is).
    """

    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}
        self.latest = 0.0  # the newest time a window was looked at (trio.current_time())

    def _window(self, caller: str, now: float) -> _Window:
        """The caller's window, made if it has none (only an admission makes one)."""
        window = self._windows.get(caller)
        if window is None:
            window = self._windows[caller] = _Window()
        window.expire(now)
        self.latest = max(self.latest, now)
        return window

    def _peek(self, caller: str, now: float) -> _Window:
        """The caller's window to read (an empty one, not kept, when it has none)."""
        window = self._windows.get(caller)
        if window is None:
            return _NO_WINDOW
        window.expire(now)
        self.latest = max(self.latest, now)
        return window

    def forget(self, now: float, keep: Callable[[str], bool]) -> None:
        """Drop the windows that hold nothing any more, and those of callers ``keep`` refuses (a key a reload removed)."""
        for caller, window in list(self._windows.items()):
            window.expire(now)
            if not window.admitted or not keep(caller):
                del self._windows[caller]

    def __contains__(self, caller: str) -> bool:
        """Whether the caller has a window here (it admitted a request in the last minute)."""
        return caller in self._windows

    def __len__(self) -> int:
        """The windows kept now."""
        return len(self._windows)

    def reserve(
        self,
        caller: str,
        tokens: int,
        *,
        tokens_per_minute: int | None,
        requests_per_minute: int | None,
        now: float,
        whole: str = "the key's whole budget",
    ) -> Grant | None:
        """Admit a request that may cost ``tokens`` for ``caller``, or raise; None when the caller has no budget.

        ``whole`` names the token budget in the 400's message (a replica's share of it, under ``[cluster]``).

        Raises:
          InvalidRequest: the request alone is over the whole token budget.
          BudgetExceeded: the window does not hold it now; ``retry_after`` says when it will (both budgets counted).
        """
        if tokens_per_minute is None and requests_per_minute is None:
            return None
        check_whole(tokens, tokens_per_minute, whole)
        over = self.shortfall(caller, tokens, tokens_per_minute=tokens_per_minute, requests_per_minute=requests_per_minute, now=now)
        if over:
            wait = max(w for w, _ in over)  # the window holds it when both budgets do
            raise BudgetExceeded(
                f"the caller {caller!r} {' and '.join(why for _, why in over)}; retry after {wait:.1f} s", retry_after=wait
            )
        return self.admit(caller, tokens, tokens_per_minute=tokens_per_minute, requests_per_minute=requests_per_minute, now=now)

    def shortfall(
        self, caller: str, tokens: int, *, tokens_per_minute: int | None, requests_per_minute: int | None, now: float
    ) -> list[tuple[float, str]]:
        """Why the window does not hold ``tokens`` more within these allowances, each with when it will; [] when it does.

        A wait is WINDOW when the allowance is below the request itself (a replica's share, with Redis away).
        """
        window = self._peek(caller, now)
        over: list[tuple[float, str]] = []
        if requests_per_minute is not None and window.requests + 1 > requests_per_minute:
            wait = window.wait_for(window.requests + 1 - requests_per_minute, "requests", now)
            over.append((wait, f"has used its {requests_per_minute} requests a minute"))
        if tokens_per_minute is not None and window.tokens + tokens > tokens_per_minute:
            wait = window.wait_for(window.tokens + tokens - tokens_per_minute, "tokens", now)
            left = max(0, tokens_per_minute - window.tokens)
            over.append((wait, f"has {left} of its {tokens_per_minute} tokens a minute left, this request may take {tokens}"))
        return over

    def admit(
        self,
        caller: str,
        tokens: int,
        *,
        tokens_per_minute: int | None,
        requests_per_minute: int | None,
        now: float,
        elsewhere: tuple[int, int] = (0, 0),
    ) -> Grant:
        """Count the request in the caller's window now (the caller checked it fits); its headers show these budgets.

        ``elsewhere``: the (tokens, requests) of the budgets in use on the other replicas, for the remaining counts.
        """
        window = self._window(caller, now)
        entry = _Admitted(now, tokens)
        window.admitted.append(entry)
        window.tokens += tokens
        window.requests += 1
        return Grant(window, entry, _limits(window, tokens_per_minute, requests_per_minute, now, elsewhere))

    def in_window(self, caller: str, now: float) -> tuple[int, int]:
        """The (tokens, requests) the caller's window holds now: what this replica uses of its budgets."""
        window = self._peek(caller, now)
        return window.tokens, window.requests

    def oldest(self, caller: str, now: float) -> float | None:
        """When the oldest admission still in the caller's window here was made; None: the window is empty."""
        window = self._peek(caller, now)
        return window.admitted[0].at if window.admitted else None

    def reset_in(self, caller: str, count: str, now: float) -> float:
        """Seconds until none of ``count`` is left in the caller's window here."""
        return self._peek(caller, now).reset_in(count, now)

    def wait_for(self, caller: str, over: int, count: str, now: float) -> float:
        """Seconds until the caller's oldest admissions here leave with ``over`` of their ``count``; WINDOW if they never do."""
        window = self._peek(caller, now)
        return window.wait_for(over, count, now) if over <= getattr(window, count) else WINDOW

    def limits(
        self,
        caller: str,
        *,
        tokens_per_minute: int | None,
        requests_per_minute: int | None,
        now: float,
        elsewhere: tuple[int, int] = (0, 0),
        expire: bool = True,
    ) -> RateLimits:
        """The caller's budgets as they stand (for the headers of a refusal).

        ``expire=False`` reads the sums as the last request left them, changing
        nothing: for a reader on another thread than the event loop's.
        """
        window = self._windows.get(caller) or _NO_WINDOW
        if expire:
            window.expire(now)
        return _limits(window, tokens_per_minute, requests_per_minute, now, elsewhere)


def whole_budgets(caller: Caller, config: Config) -> tuple[int | None, int | None]:
    """The caller's whole (tokens, requests) a minute, across every replica: its key's, or [limits]' anonymous ones."""
    if caller is ANONYMOUS:
        return config.limits.anonymous_tokens_per_minute, config.limits.anonymous_requests_per_minute
    return caller.tokens_per_minute, caller.requests_per_minute


def budgets_of(caller: Caller, config: Config) -> tuple[int | None, int | None]:
    """The caller's (tokens, requests) a minute on this replica when it holds no grant of them from a ledger.

    With ``[cluster]`` but no ledger each replica keeps its ``static_share``
    of them (the shares add up to at most 1): strict fleet-wide, though a
    key sending to one replica only gets that replica's share. With the
    ledger the grants follow demand instead (router/quotas/budget_grants.py).
    """
    tokens, requests = whole_budgets(caller, config)
    if config.cluster is None:
        return tokens, requests
    share = config.cluster.static_share
    return _share_of(tokens, share), _share_of(requests, share)


def _share_of(budget: int | None, share: float) -> int | None:
    return None if budget is None else max(1, math.floor(budget * share + 1e-9))  # 100 x 0.29 is 29, not 28.999...


def budget_name(config: Config) -> str:
    """What a 400 over the whole token budget calls it: under ``[cluster]``, this replica's share."""
    return "the key's whole budget" if config.cluster is None else "this replica's share (cluster.static_share) of the key's budget"
