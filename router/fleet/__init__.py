"""The engines and their pools: seats, lending, placement, health, discovery and rebalancing."""

from __future__ import annotations

from .credentials import ask_key as ask_key, key_refused as key_refused, key_unproven as key_unproven, note_credentials as note_credentials
from .discovery import Discovery as Discovery, Found as Found
from .endpoint import Endpoint as Endpoint, url_seed as url_seed
from .health import HealthStreaks as HealthStreaks
from .lender_latency import RecentMean as RecentMean, RecentPeak as RecentPeak
from .model_len import ModelLenError as ModelLenError, ask_model_lens as ask_model_lens, ask_timeout as ask_timeout
from .outlier import record_success as record_success, report_failure as report_failure
from .policies import (
    PLACEMENT_KINDS as PLACEMENT_KINDS,
    LeastLoaded as LeastLoaded,
    Placement as Placement,
    PrefixAffinity as PrefixAffinity,
    rendezvous_order as rendezvous_order,
    rendezvous_weight as rendezvous_weight,
)
from .pool import Lease as Lease, Pool as Pool, PoolStatistics as PoolStatistics, Rerouted as Rerouted, Ticket as Ticket
from .reconcile import Fleet as Fleet, TransportFactory as TransportFactory
from .response_homes import ResponseHomes as ResponseHomes
