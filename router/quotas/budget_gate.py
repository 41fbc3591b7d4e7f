"""A request's token and request budgets at admission: this process's windows alone, or its grants of the ledger's.

The request path asks one thing -- may this request cost this much for its
caller now -- and the answer must be the same in shape whether the budgets
are this process's (no ``[cluster]``, or ``[cluster]`` with no ledger: each
replica its static share) or the fleet's, shared through the ledger
(router/quotas/budget_grants.py). Either way the caller's ``x-ratelimit-*``
headers are put on the request's record, on success and on refusal, and
/metrics reads what is left of each budget from here.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..config import Config
from ..errors import BudgetExceeded, InvalidRequest
from ..observe import RequestRecord
from .auth import Caller
from .budget_grants import BudgetGrants, KeyBudget
from .budgets import Budgets, Grant, RateLimits, budget_name, budgets_of, check_whole, whole_budgets
from .ledger import AdmissionLedger

__all__ = ["BudgetGate"]


class BudgetGate:
    """Every budgeted caller's window here, its share of the ledger's grants under ``[cluster]``, and its budgets as last seen."""

    def __init__(self) -> None:
        self._windows = Budgets()  # each caller's tokens and requests of the last minute, admitted here
        self._shares: BudgetGrants | None = None  # with the ledger: each key's grants of its budgets (made at first use)
        self._caps: dict[str, tuple[int | None, int | None]] = {}  # per caller: its budgets, as its last request had them

    async def reserve(
        self, caller: Caller, tokens: int, record: RequestRecord, config: Config, shared: AdmissionLedger | None, *, priority: int, deadline: float
    ) -> Grant | None:
        """Hold what the request may cost (``tokens``) in the caller's budgets; None when it has none.

        With ``shared`` (the ledger), the request waits for a grant until
        ``deadline``, in ``priority`` order (router/quotas/budget_grants.py).

        Raises:
          InvalidRequest: the request alone is over the whole token budget.
          BudgetExceeded: the budget does not hold it now; ``retry_after`` says when it will.
        """
        per_minute = budgets_of(caller, config) if shared is None else whole_budgets(caller, config)
        if per_minute == (None, None):
            return None
        self._caps[caller.name] = per_minute
        key = None if shared is None else self._share_of(shared, caller.name, per_minute)
        try:
            if key is None:
                grant = self._windows.reserve(
                    caller.name, tokens, tokens_per_minute=per_minute[0], requests_per_minute=per_minute[1], now=trio.current_time(),
                    whole=budget_name(config),
                )
                assert grant is not None  # the caller has a budget
            else:
                check_whole(tokens, per_minute[0])
                grant = await key.reserve(tokens, priority=priority, deadline=deadline)
        except (BudgetExceeded, InvalidRequest):  # its answer says what is left too
            record.rate_limits = self._limits(caller.name, per_minute, key, trio.current_time()).headers()
            raise
        record.rate_limits = grant.limits.headers()
        record.budget_at, record.budget_tokens = grant.at, grant.tokens
        return grant

    def left(self) -> dict[str, RateLimits]:
        """Each caller with a budget that has sent here: its budgets as they stand (fleet-wide under the ledger)."""
        try:
            now, in_loop = trio.current_time(), True
        except RuntimeError:  # read on another thread (a metrics render outside the event loop): as the last request left it
            now, in_loop = self._windows.latest, False
        shares = self._shares
        return {
            name: self._limits(name, per_minute, None if shares is None else shares.get(name), now, expire=in_loop)
            for name, per_minute in list(self._caps.items())
        }

    def forget(self, now: float, keep: Callable[[str], bool]) -> None:
        """Drop the windows that emptied and those of callers ``keep`` refuses (a key a reload removed), and their budgets as last seen.

        A key with nothing admitted here in the last minute has its whole
        budget left here: /metrics stops showing it until it sends again.
        """
        self._windows.forget(now, keep)
        for name in [name for name in self._caps if name not in self._windows]:
            del self._caps[name]
        if self._shares is not None:  # [cluster]: a key's share goes once the ledger holds nothing of it
            self._shares.forget()

    @property
    def callers(self) -> int:
        """Callers whose budgets are kept here now (a window of the last minute)."""
        return len(self._windows)

    @property
    def shares(self) -> int:
        """[cluster] Keys whose shares of their budgets are kept here now (``BudgetGrants``)."""
        return 0 if self._shares is None else len(self._shares)

    def _share_of(self, shared: AdmissionLedger, name: str, per_minute: tuple[int | None, int | None]) -> KeyBudget:
        if self._shares is None or self._shares.shared is not shared:
            self._shares = BudgetGrants(shared, self._windows)
        return self._shares.of(name, *per_minute)

    def _limits(
        self, name: str, per_minute: tuple[int | None, int | None], key: KeyBudget | None, now: float, *, expire: bool = True
    ) -> RateLimits:
        elsewhere = (0, 0) if key is None else key.elsewhere()
        return self._windows.limits(
            name, tokens_per_minute=per_minute[0], requests_per_minute=per_minute[1], now=now, elsewhere=elsewhere, expire=expire
        )
