"""The wait for a seat: a priority and deadline queue, tenants' fair shares of it, and when to retry."""

from __future__ import annotations

from .fair_share import NO_SHARE as NO_SHARE, FairClock as FairClock, Share as Share
from .fair_share_sync import FairTrade as FairTrade, Served as Served, ServiceStore as ServiceStore
from .queue import SKIP as SKIP, Skip as Skip, WaitQueue as WaitQueue, WaitQueueStatistics as WaitQueueStatistics
from .retry_hint import CEILING as CEILING, RetryHints as RetryHints, whole_seconds as whole_seconds
