"""Read-only views of the router's state: statistics, /health, the pools' assignment, the models served."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .admission import KindRatio
from .backend import BackendLoad
from .config import Config
from .fleet import Endpoint, Fleet, PoolStatistics
from .quotas import ClusterStatus, RateLimits, Traffic


@dataclass(frozen=True)
class EndpointStatistics:
    """One endpoint as the router sees it, next to what the engine says of itself."""

    url: str
    pool: str
    in_flight: int
    max_concurrency: int
    healthy: bool
    load: BackendLoad | None
    ejected: bool = False  # taken out by outlier detection for now
    ejections: int = 0  # times ejected since the process started
    failures_in_a_row: int = 0
    busy_answers: int = 0  # 503s before any byte (the engine's own queue full), ever
    key_refused: bool = False  # the engine refuses tailguard's key now (down until it takes it)
    # Its engine's learnt time to a stream's first byte: base seconds, and seconds a prompt token queued (0: not built).
    first_byte_base: float = 0.0
    first_byte_seconds_per_token: float = 0.0
    # Tokens of context its requests in flight hold (prompt and max_tokens), and the fill placement compares (Endpoint.fill).
    context_tokens: int = 0
    fill: float = 0.0


@dataclass(frozen=True)
class KeptPerCaller:
    """What the router keeps per caller now: each follows the callers in use, never every key ever seen."""

    in_flight: int  # callers with a request queued or running
    budget_windows: int  # callers with a budget window of the last minute
    fair_tags: int  # finish tags in the pools' fair clocks (a tenant may have one in each pool)
    fair_served: int  # served totals in the pools' fair clocks (what [cluster] replicas trade)
    ledger_keys: int = 0  # [cluster]: keys' budget shares and seats kept for the ledger (gone once it holds nothing of them)


@dataclass(frozen=True)
class RouterStatistics:
    pools: tuple[PoolStatistics, ...]
    endpoints: tuple[EndpointStatistics, ...]
    requests_total: int
    config_digest: str
    draining: bool
    open_requests: int
    caller_in_flight: dict[str, int]
    retries: dict[str, int] | None = None  # per pool: failed calls tried again on another endpoint
    backend_clients: int = 0  # open HTTP clients to backends, the retired ones still closing included
    moves: dict[tuple[str, str], int] = field(default_factory=dict)  # (from, to) -> endpoints moved by rebalancing
    moving: dict[str, tuple[str, str]] = field(default_factory=dict)  # endpoint URL -> (from, to), while it drains
    lent: dict[str, int] = field(default_factory=dict)  # per pool: its seats serving other pools' requests now
    borrowed: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, lender) -> requests seated, ever
    cluster: ClusterStatus | None = None  # [cluster]: the shared ledger's mode and this replica's grants
    # Per caller with a budget that has sent here: what is left of it now (fleet-wide under [cluster]).
    budgets_left: dict[str, RateLimits] = field(default_factory=dict)
    kept: KeptPerCaller = KeptPerCaller(0, 0, 0, 0, 0)
    # Per model and kind of text some answer taught: the factor the prompt estimate is corrected by (router/admission/prompt_ratios.py).
    prompt_ratios: tuple[KindRatio, ...] = ()

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.pools)

    @property
    def waiting(self) -> int:
        return sum(p.queue.waiting for p in self.pools)

    def pool(self, name: str) -> PoolStatistics:
        return next(p for p in self.pools if p.name == name)


def endpoint_statistics(endpoint: Endpoint, pool: str) -> EndpointStatistics:
    """``endpoint`` as a member of the pool named ``pool``."""
    e = endpoint
    return EndpointStatistics(
        e.url,
        pool,
        e.in_flight,
        e.max_concurrency,
        e.healthy,
        e.load,
        ejected=e.ejected,
        ejections=e.ejections,
        failures_in_a_row=e.failures_in_a_row,
        busy_answers=e.busy_answers,
        key_refused=e.auth_failure is not None,
        first_byte_base=e.first_byte_model.base,
        first_byte_seconds_per_token=e.first_byte_model.seconds_per_token,
        context_tokens=e.context_tokens,
        fill=e.fill() if e.seats else 0.0,
    )


def statistics(
    fleet: Fleet,
    traffic: Traffic,
    budgets_left: dict[str, RateLimits] | None = None,
    *,
    budget_callers: int = 0,
    ledger_keys: int = 0,
    prompt_ratios: tuple[KindRatio, ...] = (),
) -> RouterStatistics:
    pools = fleet.pools
    fair = [pool.queue.fair.statistics() for pool in pools.values()]
    return RouterStatistics(
        pools=tuple(pool.statistics() for pool in pools.values()),
        endpoints=tuple(endpoint_statistics(e, pool.name) for pool in pools.values() for e in pool.endpoints),
        requests_total=traffic.requests_total,
        config_digest=fleet.config.digest,
        draining=traffic.draining,
        open_requests=traffic.open_requests,
        caller_in_flight=dict(traffic.caller_in_flight),
        retries={name: traffic.retries[name] for name in pools},
        moves=dict(fleet.moves),
        moving=dict(fleet.moving),
        lent={name: pool.lending.lent for name, pool in pools.items()},
        borrowed={(name, lender): n for name, pool in pools.items() for lender, n in pool.lending.borrowed_total.items()},
        cluster=None if fleet.budget is None else fleet.budget.status(),
        backend_clients=fleet.open_clients,
        budgets_left=budgets_left or {},
        kept=KeptPerCaller(
            len(traffic.caller_in_flight), budget_callers, sum(f.tagged for f in fair), sum(f.served for f in fair), ledger_keys
        ),
        prompt_ratios=prompt_ratios,
    )


def health(fleet: Fleet, draining: bool) -> dict[str, Any]:
    """Ready only when every pool has a healthy endpoint; says which are not."""
    pools: dict[str, dict[str, Any]] = {}
    for pool in fleet.pools.values():
        pools[pool.name] = {"healthy": pool.healthy, "endpoints": {e.url: _state(e) for e in pool.endpoints}}
        reasons = {e.url: e.auth_failure for e in pool.endpoints if e.auth_failure is not None}
        if reasons:
            pools[pool.name]["reasons"] = reasons  # why an endpoint is down, where the router knows better than "down"
    ready = not draining and all(p["healthy"] for p in pools.values())
    status = "ready" if ready else "unavailable"
    view: dict[str, Any] = {"status": status, "draining": draining, "pools": pools}
    budget = fleet.budget
    if budget is not None:
        mode = budget.mode
        view["cluster"] = {"mode": mode, "replica": budget.replica}
        if ready and mode == "fallback":
            view["status"] = "degraded"  # serving, on static shares of the caps: not down
    return view


def assignment(fleet: Fleet) -> list[dict[str, Any]]:
    """Each pool's GPUs now, for ``/v1/limits`` (no URLs): rebalancing and lending show here."""
    moving_out = Counter(source for source, _ in fleet.moving.values())
    moving_in = Counter(target for _, target in fleet.moving.values())
    return [
        {
            "pool": pool.name,
            "endpoints": len(pool.endpoints),
            "max_concurrency": pool.max_concurrency,
            "configured_max_concurrency": pool.config.max_concurrency,
            "endpoints_leaving": moving_out[pool.name],
            "endpoints_joining": moving_in[pool.name],
            "seats_lent": pool.lending.lent,
            "lends_to": list(pool.config.lend.to),
            "rebalance": pool.config.rebalance,
        }
        for pool in fleet.pools.values()
    ]


def models(config: Config) -> dict[str, int]:
    """Every model some pool serves, in the file's order, with the context a caller can size a prompt to:
    the smallest ``max_model_len`` of the pools serving it (a prompt sized so fits whichever pool its class picks)."""
    lens: dict[str, int] = {}
    for pool in config.pools:
        for model in pool.models:
            lens[model] = min(lens.get(model, pool.max_model_len), pool.max_model_len)
    return lens


def _state(endpoint: Endpoint) -> str:
    """An endpoint's state for /health: unknown (no probe has judged it yet: it takes nothing), up, down
    (health check, or its key refused), unverified (its context length) or ejected (outlier detection)."""
    if endpoint.unknown:
        return "unknown"
    if not endpoint.healthy or endpoint.auth_failure is not None:
        return "down"

    if not endpoint.fits_context:
        return "unverified"
    return "ejected" if endpoint.ejected else "up"
