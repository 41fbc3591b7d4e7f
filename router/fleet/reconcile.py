"""The router's endpoints and pools, reconciled with the config file, DNS discovery and rebalancing moves.

Every change is all or nothing: whatever can fail (new endpoints and their
clients) is built first, then a swap that changes plain fields only. The
request path reads ``pools`` and ``endpoints``; nothing else writes them.
``endpoints`` holds each engine's own endpoint; its shares
(router/fleet/seat_split.py) are in their pools' lists only.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from ..config import Config, EndpointConfig, PoolConfig
from .discovery import Found
from .endpoint import Clients, Closable, Endpoint
from .model_len import context_fits
from .pool import Pool
from .rebalance import MoveChoice, Rebalancer
from .seat_split import SeatSplit

if TYPE_CHECKING:
    from ..backend import ConnectorTransport
    from ..quotas import AdmissionLedger

log = logging.getLogger("tailguard.router")

TransportFactory = Callable[[EndpointConfig], "ConnectorTransport | None"]


class Fleet:
    """The endpoints by URL and the pools by name now, and the retired ones still finishing."""

    def __init__(
        self, config: Config, transport_factory: TransportFactory, rng: random.Random, model_lens: Mapping[str, int | None]
    ) -> None:
        self.config = config  # the file in force now: ``apply`` swaps it last
        self._transport_factory = transport_factory
        self._rng = rng
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[str, Pool] = {}
        self.retired: dict[str, Endpoint] = {}  # out of every pool, requests still running on them
        self.to_close: list[Closable] = []  # clients of retired endpoints, for the closer task
        self.close_wanted = trio.Event()
        self.budget: AdmissionLedger | None = None  # [cluster]: this replica's share of every cap
        self.rebalancer = Rebalancer()
        self.assignment_epoch = 0  # a reload starts a new one: moves begun before it are dropped
        self.moves: Counter[tuple[str, str]] = Counter()
        self.moving: dict[str, tuple[str, str]] = {}
        self.discovered: dict[str, tuple[Found, ...]] = {}  # per pool: its endpoints_dns addresses now
        self.model_lens: dict[str, int | None] = dict(model_lens)  # URL -> its last max_model_len report

    # -- the config file ----------------------------------------------------

    def apply(self, config: Config) -> None:
        """Swap to a validated config at once (``Router.apply`` says what carries over)."""
        discovered = self._discovered_under(config)
        wanted = {p.name: [*p.endpoints, *(source.endpoint(a) for source, a in discovered.get(p.name, ()))] for p in config.pools}
        built, clients = self._build((e for p in config.pools for e in wanted[p.name]), config)
        pools_built = {p.name: Pool(p, pool_of=self.pool_of, rng=self._rng) for p in config.pools if p.name not in self.pools}

        # -- the swap: nothing below raises ------------------------------------
        for endpoint in self.endpoints.values():  # the file's caps and assignment stand again
            self._drop_shares(endpoint)
        endpoints: dict[str, Endpoint] = {}
        for pool_config in config.pools:
            for endpoint_config in wanted[pool_config.name]:
                endpoints[endpoint_config.url] = self._take(endpoint_config, built, clients, config)
        pools = {p.name: self.pools.get(p.name) or pools_built[p.name] for p in config.pools}
        for url, endpoint in self.endpoints.items():
            if url not in endpoints:
                self._retire(endpoint)
        gone = [pool for pool in self.pools.values() if pool.name not in pools]
        for pool in gone:
            pool.removed = True
            pool.reconfigure(pool.config, [])
        _link_lenders(config, pools)
        for pool_config in config.pools:
            for endpoint_config in wanted[pool_config.name]:  # before any waiter is seated on it
                self.gate(endpoints[endpoint_config.url], pool_config)
            pools[pool_config.name].reconfigure(pool_config, [endpoints[e.url] for e in wanted[pool_config.name]])
            pools[pool_config.name].queue.hints.computed = config.timeouts.retry_after_hint == "computed"
        for pool in pools.values():  # room a new lender opened
            pool.queue.dispatch()
        self.endpoints = endpoints
        self.pools = pools
        self.assignment_epoch += 1  # the file's assignment stands again: moves in progress end here
        self.moving.clear()
        self.rebalancer.reset()
        self.discovered = discovered
        self.config = config
        # Waiters of a pool removed or left with no endpoint go where their class goes now, or fail at once
        # (an emptied pool answers no_backend, unless a lender would take them): they are decided again.
        for pool in [*gone, *(p for p in pools.values() if not p.endpoints)]:
            pool.reroute_waiters()

    def pool_of(self, endpoint: Endpoint) -> Pool | None:
        """The pool ``endpoint`` serves now (None: retired, or on a rebalancing move)."""
        name = endpoint.pool_name
        return None if name is None else self.pools.get(name)

    def _build(self, configs: Iterable[EndpointConfig], config: Config) -> tuple[dict[str, Endpoint], dict[str, Clients]]:
        """New endpoints, and new clients for known ones, for ``configs``; nothing changes yet (may raise)."""
        built: dict[str, Endpoint] = {}
        clients: dict[str, Clients] = {}
        for endpoint_config in configs:
            url = endpoint_config.url
            known = self.endpoints.get(url) or self.retired.get(url)
            if known is None:
                built[url] = endpoint = self._new_endpoint(endpoint_config, config)
                if self.budget is not None:
                    endpoint.granted = 0  # [cluster]: none of its seats until the ledger grants this replica some
            else:
                clients[url] = known.clients_for(endpoint_config)
        if built and self.budget is not None:
            self.budget.wake()
        return built, clients

    def _take(self, endpoint_config: EndpointConfig, built: dict[str, Endpoint], clients: dict[str, Clients], config: Config) -> Endpoint:
        """The endpoint for ``endpoint_config`` after ``_build``: the new one, or the known one adopting it (never raises)."""
        url = endpoint_config.url
        endpoint = built.get(url)
        if endpoint is None:
            # A removed endpoint that comes back keeps its in-flight count.
            endpoint = self.endpoints.get(url) or self.retired.pop(url)
            endpoint.adopt(endpoint_config, clients[url], max_body_bytes=config.server.max_backend_body_bytes)
        return endpoint

    def _retire(self, endpoint: Endpoint) -> None:
        """Out of every pool: running requests finish (and hold its seats), nobody new."""
        self._drop_shares(endpoint)
        endpoint.retire()
        if endpoint.in_flight:
            self.retired[endpoint.url] = endpoint

    def _new_endpoint(self, endpoint_config: EndpointConfig, config: Config) -> Endpoint:
        endpoint = Endpoint(
            endpoint_config,
            connect_timeout=config.timeouts.connect_timeout,
            transport=self._transport_factory(endpoint_config),
            closer=self.close_later,
            max_body_bytes=config.server.max_backend_body_bytes,
            keep_alive_timeout=config.timeouts.backend_keep_alive_timeout,
        )
        endpoint.max_model_len = self.model_lens.get(endpoint.url)
        return endpoint

    def close_later(self, client: Closable) -> None:
        """Hand an idle retired client to the closer task (closing is async; releases are not)."""
        self.to_close.append(client)
        self.close_wanted.set()
        if self.retired:
            self.retired = {u: e for u, e in self.retired.items() if e.in_flight}

    @property
    def open_clients(self) -> int:
        """Open HTTP clients to backends, the retired ones still closing included."""
        return sum(e.open_clients for e in [*self.endpoints.values(), *self.retired.values()]) + len(self.to_close)

    # -- discovery ------------------------------------------------------------

    def _discovered_under(self, config: Config) -> dict[str, tuple[Found, ...]]:
        """The addresses resolved so far, for the pools and ``endpoints_dns`` entries ``config`` still has.

        Each keeps its entry's new settings (a changed per-endpoint cap
        applies now); an address that is already another endpoint is left out.
        """
        claimed = {e.url for p in config.pools for e in p.endpoints}
        kept: dict[str, tuple[Found, ...]] = {}
        for pool_config in config.pools:
            sources = {source.key: source for source in pool_config.endpoints_dns}
            found: list[Found] = []
            for old, address in self.discovered.get(pool_config.name, ()):
                source = sources.get(old.key)
                if source is None:
                    continue  # the entry left the file
                url = source.endpoint(address).url
                if url not in claimed:
                    claimed.add(url)
                    found.append((source, address))
            if found:
                kept[pool_config.name] = tuple(found)
        return kept

    def replace_discovered(self, pool_name: str, found: Sequence[Found]) -> None:
        """One pool's endpoints from DNS are now ``found`` (``Router.replace_discovered`` says how)."""
        pool = self.pools.get(pool_name)
        if pool is None:
            return  # a reload removed the pool meanwhile
        config = self.config
        static = {e.url for p in config.pools for e in p.endpoints}
        current = {e.url: e for e in pool.endpoints if e.url not in static and e.engine is None}  # its endpoints from DNS now (no share)
        sources = {source.key: source for source in pool.config.endpoints_dns}
        wanted: dict[str, EndpointConfig] = {}
        kept: list[Found] = []
        for old, address in found:
            source = sources.get(old.key)
            if source is None:
                continue  # the entry left the file meanwhile
            endpoint_config = source.endpoint(address)
            other = self.endpoints.get(endpoint_config.url)
            if endpoint_config.url in static or (other is not None and not pool.holds(other)):
                log.warning("pool %s: %s (from %s) is already an endpoint elsewhere; left there", pool_name, endpoint_config.url, source.name)
                continue
            wanted[endpoint_config.url] = endpoint_config
            kept.append((source, address))
        changed = [c for url, c in wanted.items() if url not in current or current[url].max_concurrency != c.max_concurrency]
        gone = [endpoint for url, endpoint in current.items() if url not in wanted]
        if changed or gone:
            self._swap_discovered(config, pool, current, changed, gone)
            log.info(
                "pool %s: endpoints from DNS now %d (added %s; removed %s)",
                pool_name, len(wanted), ", ".join(c.url for c in changed if c.url not in current) or "none",
                ", ".join(e.url for e in gone) or "none",
            )  # fmt: skip
            pool.queue.dispatch()  # room the new endpoints opened
        self.discovered[pool_name] = tuple(kept)

    def _swap_discovered(
        self, config: Config, pool: Pool, current: Mapping[str, Endpoint], changed: Sequence[EndpointConfig], gone: Sequence[Endpoint]
    ) -> None:
        """Build what ``changed`` needs, then swap ``pool``'s endpoints from DNS (all or nothing)."""
        built, clients = self._build(changed, config)
        # -- the swap: nothing below raises ------------------------------------
        added = [self._take(c, built, clients, config) for c in changed if c.url not in current]
        for c in changed:
            if c.url in current:
                self._drop_shares(current[c.url])  # the new cap is all its own, as a reload would have it
                self._take(c, built, clients, config)  # a new per-endpoint cap
        for endpoint in gone:
            del self.endpoints[endpoint.url]
            self._retire(endpoint)
        for endpoint in added:
            self.gate(endpoint, pool.config)  # a new address of a discovered max_model_len waits to be asked
            endpoint.pool_name = pool.name
            self.endpoints[endpoint.url] = endpoint
            if self.budget is not None:
                endpoint.granted = 0  # [cluster]: none of its seats until the ledger grants this replica some
        if added and self.budget is not None:
            self.budget.wake()
        pool.endpoints = [*(e for e in pool.endpoints if e not in gone), *added]

    # -- context length (router/fleet/model_len.py) -----------------------------

    def note_model_lens(self, reported: Mapping[str, int | None]) -> None:
        """What endpoints just reported in GET /v1/models; kept for endpoints to come."""
        self.model_lens.update(reported)
        for url, value in reported.items():
            endpoint = self.endpoints.get(url)
            if endpoint is not None:
                news = value != endpoint.max_model_len
                endpoint.max_model_len = value
                for member in [endpoint] if endpoint.split is None else endpoint.split.members:
                    member.max_model_len = value
                    pool = self.pool_of(member)
                    if pool is not None:
                        self.gate(member, pool.config, news=news)

    def gate(self, endpoint: Endpoint, pool: PoolConfig, *, news: bool = False) -> None:
        """Let ``endpoint`` take ``pool``'s requests only if its context length is known to fit.

        Logged when that changes, and when an endpoint kept out says something new.
        """
        fits = context_fits(endpoint.max_model_len, pool)
        if fits == endpoint.fits_context and (fits or not news):
            return
        endpoint.fits_context = fits
        if fits:
            log.info("endpoint %s reports max_model_len %s: it serves pool %s", endpoint.url, endpoint.max_model_len, pool.name)
        elif endpoint.max_model_len is None:
            log.warning(
                "endpoint %s takes no requests of pool %s until it reports a max_model_len of at least %d (GET /v1/models)",
                endpoint.url, pool.name, pool.max_model_len,
            )
        else:
            log.warning(
                "endpoint %s reports max_model_len %d, less than pool %s's %d: it takes none of the pool's requests"
                " (start it with --max-model-len >= %d, or reload to ask every endpoint again)",
                endpoint.url, endpoint.max_model_len, pool.name, pool.max_model_len, pool.max_model_len,
            )

    # -- rebalancing moves ----------------------------------------------------

    def start_move(self, choice: MoveChoice) -> int:
        """Take ``choice``'s endpoint out of its pool while its running requests finish; the epoch to finish it in."""
        endpoint, source, target = choice.endpoint, choice.source, choice.target
        source.endpoints = [e for e in source.endpoints if e is not endpoint]
        source.cap_moved -= endpoint.max_concurrency
        endpoint.pool_name = None  # no pool's new requests while its running ones finish
        self.moving[endpoint.url] = (source.name, target.name)
        log.info(
            "rebalancing: endpoint %s leaves pool %s (utilisation %.2f) for pool %s (%.2f); %d requests still run there",
            endpoint.url, source.name, choice.source_utilisation, target.name, choice.target_utilisation, endpoint.in_flight,
        )
        return self.assignment_epoch

    async def finish_move(self, endpoint: Endpoint, source: str, target: Pool, epoch: int) -> None:
        """Once ``endpoint`` is idle, it joins ``target`` -- unless a reload came first."""
        await endpoint.wait_idle()
        if epoch != self.assignment_epoch or endpoint.retired:
            return  # a reload came first: the file's assignment stands
        self.gate(endpoint, target.config)
        target.endpoints = [*target.endpoints, endpoint]
        target.cap_moved += endpoint.max_concurrency
        endpoint.pool_name = target.name
        split = endpoint.split
        share = None if split is None else split.share_in(target.name)
        if split is not None and share is not None:  # its seats already there join it: one endpoint of the engine a pool
            target.endpoints = [e for e in target.endpoints if e is not share]
            split.drop(share)
        self.moving.pop(endpoint.url, None)
        self.moves[(source, target.name)] += 1
        log.info("rebalancing: endpoint %s joined pool %s (from %s)", endpoint.url, target.name, source)
        target.queue.dispatch()

    def move_seats(self, choice: MoveChoice) -> None:
        """Move ``choice.seats`` seats of an engine between the pools it serves (``MoveChoice`` says which way).

        The caps change now; the engine's running requests keep their seats,
        and the moved seats become usable only as the engine's requests fall
        within what the caps leave (``SeatSplit.room_for``).
        """
        endpoint, source, target, seats = choice.endpoint, choice.source, choice.target, choice.seats or 0
        engine = endpoint.engine or endpoint
        split = engine.split or SeatSplit(engine, self._wake)
        engine.split = split
        if endpoint.engine is None:  # the engine's own endpoint gives seats to its share in ``target``
            share = split.share_in(target.name)
            if share is None:
                share = engine.new_share()
                share.split, share.pool_name = split, target.name
                split.shares.append(share)
                self.gate(share, target.config)
                target.endpoints = [*target.endpoints, share]
            engine.max_concurrency -= seats
            share.max_concurrency += seats
        else:  # a share gives seats back to its engine
            endpoint.max_concurrency -= seats
            engine.max_concurrency += seats
            if not endpoint.max_concurrency:
                source.endpoints = [e for e in source.endpoints if e is not endpoint]
                split.drop(endpoint)
        source.cap_moved -= seats
        target.cap_moved += seats
        self.moves[(source.name, target.name)] += 1
        log.info(
            "rebalancing: %d seats of endpoint %s leave pool %s (utilisation %.2f) for pool %s (%.2f);"
            " %d requests still run on the engine; its seats now %s",
            seats, engine.url, source.name, choice.source_utilisation, target.name, choice.target_utilisation,
            sum(m.in_flight for m in split.members), _seats_by_pool(split),
        )  # fmt: skip
        target.queue.dispatch()

    def _drop_shares(self, engine: Endpoint) -> None:
        """Every share of ``engine`` leaves its pool, its seats back with the engine (its running requests finish)."""
        split = engine.split
        if split is None:
            return
        home = self.pool_of(engine)
        for share in split.serving:
            pool = self.pool_of(share)
            seats = split.drop(share)
            if pool is not None:
                pool.endpoints = [e for e in pool.endpoints if e is not share]
                pool.cap_moved -= seats
            if home is not None:
                home.cap_moved += seats

    def _wake(self, endpoint: Endpoint) -> None:
        """A seat of ``endpoint``'s engine freed: the waiters of the pool it serves may use it."""
        pool = self.pool_of(endpoint)
        if pool is not None:
            pool.queue.dispatch()


def _seats_by_pool(split: SeatSplit[Endpoint]) -> str:
    """``interactive 8, batch 24``: each pool's cap on one engine, for the log."""
    return ", ".join(f"{m.pool_name} {m.max_concurrency}" for m in split.members if m.pool_name is not None) or "none"


def _link_lenders(config: Config, pools: Mapping[str, Pool]) -> None:
    """Who lends to whom, and what each pool's own classes are promised (what lending may cost them), as the file says now."""
    for pool in pools.values():
        pool.lending.lenders, pool.lending.borrowers = [], []
        promised = [c.objective.ttft for c in config.classes if c.pool == pool.name and c.objective.ttft is not None]
        pool.lending.promise = min(promised, default=None)
        paced = [c.objective.itl for c in config.classes if c.pool == pool.name and c.objective.itl is not None]
        pool.lending.token_promise = min(paced, default=None)
    for pool_config in config.pools:
        for name in pool_config.lend.to:
            pools[pool_config.name].lending.borrowers.append(pools[name])
            pools[name].lending.lenders.append(pools[pool_config.name])
