"""tailguard.router: the core, free of wire formats.

The front ends hold one :class:`Router` and open a :class:`Session` per request;
everything else is grouped by concern, each group importing only those below it:

- ``admission``: what a request is and the decision on it (caps, estimate, class, prefix)
- ``fleet``: the engines and their pools (seats, lending, placement, health, rebalancing)
- ``quotas``: who is calling and how much they may use (keys, budgets, the shared ledger)
- ``queueing``: the wait for a seat (deadline queue, tenants' fair shares, Retry-After)
- ``backend``: calls to one engine (transports, the checked stream, its load)
- ``observe``: each request's record and trace, the event loop's lag
- ``config``: ``config.toml`` read into frozen types

On top, the request path (``request_path``, ``session``, ``dispatch``, ``views``,
``upkeep``); at the bottom, the vocabulary every group shares (``errors``,
``error_spec``, ``ids``, ``sockets``).
"""

from __future__ import annotations

from .dispatch import Router as Router
from .request_path import Completion as Completion
from .session import ClientLeft as ClientLeft, Session as Session, Sessions as Sessions, checked_header as checked_header
from .views import RouterStatistics as RouterStatistics
