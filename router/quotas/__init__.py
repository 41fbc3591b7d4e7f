"""Who is calling and how much they may use: API keys, token budgets, in-flight caps, the shared ledger."""

from __future__ import annotations

from .auth import (
    ANONYMOUS as ANONYMOUS,
    Authenticator as Authenticator,
    Caller as Caller,
    check_token as check_token,
    hash_key as hash_key,
    one_authorization as one_authorization,
)
from .budget_gate import BudgetGate as BudgetGate
from .budget_grants import BudgetGrants as BudgetGrants
from .budgets import WINDOW as WINDOW, Budgets as Budgets, RateLimits as RateLimits, budgets_of as budgets_of, duration as duration
from .key_seats import KeySeats as KeySeats
from .ledger import AdmissionLedger as AdmissionLedger
from .ledger_terms import (
    NO_TERMS as NO_TERMS,
    NO_WAITER as NO_WAITER,
    ClusterStatus as ClusterStatus,
    Demand as Demand,
    LedgerStore as LedgerStore,
    Synced as Synced,
    SyncTerms as SyncTerms,
    Want as Want,
    Yielding as Yielding,
)
from .shed import WINDOW_SECONDS as WINDOW_SECONDS, AdaptiveShed as AdaptiveShed
from .traffic import Traffic as Traffic
