"""The router's background loops: health checks, load scrapes, rebalancing, the shared budget, closing retired clients.

Each loop reads the config anew every turn (a reload changes intervals and
thresholds at once), and a turn that fails is logged, never fatal: a broken
probe must not stop health checking for the life of the process.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Awaitable, Callable

import trio

from .backend import REFUSED, Answer, BackendClient, ModelLenUnknown, scrape
from .config import HealthCheckKind, PoolConfig
from .fleet import Discovery, Endpoint, Fleet, HealthStreaks, Pool, ask_key, key_unproven, note_credentials
from .observe import LoopLag
from .queueing import FairTrade, ServiceStore
from .quotas import NO_WAITER, AdmissionLedger, Demand, LedgerStore, Yielding

log = logging.getLogger("tailguard.router")

# Seconds between looks for per-caller state that can no longer matter
# (``RequestPath.forget_idle``): a budget window is empty a minute after its
# last admission and goes within this much more.
FORGET_INTERVAL = 5.0


class Upkeep:
    """Runs the loops over ``fleet``, under the file in force at each turn (``fleet.config``)."""

    def __init__(self, fleet: Fleet, loop_lag: LoopLag, discovery: Discovery, forget_idle: Callable[[], Callable[[str], bool]]) -> None:
        self._fleet = fleet
        self._loop_lag = loop_lag
        self._discovery = discovery
        self._forget_idle = forget_idle  # per-caller state that can no longer matter goes
        self._trade: FairTrade | None = None  # [cluster] on Redis: fair shares traded with the other replicas
        self._health_streaks = HealthStreaks()  # probe results in a row, against each pool's thresholds
        self._newcomers = trio.Event()  # set when endpoints no probe has judged may exist (``newcomers``)
        # When each endpoint's last probe began, and what its engine had sent by then ("auto" reads it).
        # (The client by a weak reference: a reload's replaced client must not live on here.)
        self._last_turn: weakref.WeakKeyDictionary[Endpoint, tuple[float, weakref.ref[BackendClient], int]] = weakref.WeakKeyDictionary()
        # Each endpoint's first silent miss in a row: its client and the bytes heard by then (a second gives up its calls).
        self._silent: weakref.WeakKeyDictionary[Endpoint, tuple[weakref.ref[BackendClient], int]] = weakref.WeakKeyDictionary()

    async def run(self, ledger: LedgerStore | None, task_status: trio.TaskStatus[None]) -> None:
        """Every loop, forever (``Router.run`` says which); started once the first of each is done, and every
        endpoint known then (DNS's too) had its first probe: none is unknown once the process says it is ready."""
        async with trio.open_nursery() as nursery:
            config = self._fleet.config
            cluster = config.cluster
            if cluster is not None and ledger is not None:
                self._fleet.budget = AdmissionLedger(
                    cluster, ledger, self._cluster_demands, settle_after=config.timeouts.end_to_end_timeout
                )
                await nursery.start(self._fleet.budget.run)
                if isinstance(ledger, ServiceStore):  # Redis: fair shares traded too (router/queueing/fair_share_sync.py)
                    trade = FairTrade(cluster.replica(), ledger, lambda: {n: p.queue.fair for n, p in self._fleet.pools.items()})
                    self._trade = trade
                    nursery.start_soon(trade.run)
            await nursery.start(self._loop_lag.run)  # measuring before the first probe, which asks it
            await nursery.start(self._discovery.run)  # pools' DNS names: the first answers come before started
            await self.probe_unknown()  # and every endpoint known then has had its first probe
            nursery.start_soon(
                _forever, "health check", self.check_health, lambda: self._fleet.config.timeouts.health_check_interval
            )
            nursery.start_soon(self._probe_newcomers_forever)
            nursery.start_soon(_forever, "backend load scrape", self._scrape_loads, self._scrape_interval)
            nursery.start_soon(self._close_retired_forever)
            nursery.start_soon(self._rebalance_forever, nursery)
            nursery.start_soon(_forever, "forgetting idle callers", self._forget_turn, lambda: FORGET_INTERVAL)
            task_status.started()

    async def _forget_turn(self) -> None:
        keep = self._forget_idle()
        if self._trade is not None:  # what the others served a removed key orders nothing here any more
            self._trade.forget(keep)

    # -- the shared budget ([cluster]) -----------------------------------------

    def _cluster_demands(self) -> list[Demand]:
        """The pools and endpoints as this replica sees them now (every sync carries them)."""
        demands: list[Demand] = []
        for pool in self._fleet.pools.values():
            first = pool.first_waiting()  # the most urgent waiting, the oldest of its class priority
            urgent, oldest = (NO_WAITER, math.inf) if first is None else first
            waiting = pool.waiting_seats()
            demands.append(
                Demand(
                    f"pool:{pool.name}",
                    pool.cluster_cap,
                    pool.in_flight,
                    waiting,
                    urgent,
                    pool.set_grant,
                    _yielding_of(pool),
                    oldest,
                )
            )
            for endpoint in pool.endpoints:
                demands.append(
                    Demand(
                        f"endpoint:{endpoint.url}",
                        endpoint.max_concurrency,
                        endpoint.in_flight,
                        waiting,
                        urgent,  # so idle replicas give back their blocks of it
                        _endpoint_grant(endpoint, pool),
                        _yielding_of(endpoint),
                        oldest,
                    )
                )
        return demands  # API keys' seats go as each key stirs (router/quotas/ledger_roster.py), not every key every sync

    # -- rebalancing ------------------------------------------------------------

    async def _rebalance_forever(self, nursery: trio.Nursery) -> None:
        """Look at the pools' demand every ``rebalance.interval`` s; start the moves it calls for."""
        while True:
            await trio.sleep(self._fleet.config.rebalance.interval)
            try:
                self.rebalance_turn(nursery)
            except Exception:  # a bad turn must not end rebalancing, nor the process
                log.exception("a rebalancing turn failed")

    def rebalance_turn(self, nursery: trio.Nursery) -> None:
        """One look; a move that is due starts now and finishes in ``nursery``."""
        fleet = self._fleet
        now = trio.current_time()
        choice = fleet.rebalancer.look(now, fleet.pools, self._fleet.config)
        if choice is None:
            return
        fleet.rebalancer.moved(now)
        if choice.seats is not None:  # seats of an engine, not the engine: at once (router/fleet/seat_split.py)
            fleet.move_seats(choice)
            return
        epoch = fleet.start_move(choice)
        nursery.start_soon(fleet.finish_move, choice.endpoint, choice.source.name, choice.target, epoch)

    # -- load scrapes and retired clients --------------------------------------

    def _scrape_interval(self) -> float:
        config = self._fleet.config
        interval = config.metrics.backend_scrape_interval
        return interval if interval > 0 else config.timeouts.health_check_interval

    async def _scrape_loads(self) -> None:
        """Each endpoint's own /metrics (running, waiting, KV cache), for the dashboards.

        Read on every turn, so a reload can switch scraping on or off.
        """
        config = self._fleet.config
        if config.metrics.backend_scrape_interval > 0:
            await scrape(list(self._fleet.endpoints.values()), timeout=config.timeouts.health_check_timeout)

    async def _close_retired_forever(self) -> None:
        fleet = self._fleet
        while True:
            await fleet.close_wanted.wait()
            fleet.close_wanted = trio.Event()
            await self.close_retired()

    async def close_retired(self) -> None:
        """Close every client handed to the closer so far (shielded: closing must finish)."""
        to_close = self._fleet.to_close
        while to_close:
            client = to_close.pop()
            with trio.CancelScope(shield=True):
                try:
                    await client.aclose()
                except Exception:  # a client that fails to close must not stop the closer
                    log.exception("closing a retired backend client failed")

    # -- health checks ----------------------------------------------------------

    async def check_health(self) -> None:
        """Probe every endpoint once, concurrently; wake waiters on recovery (``Router.check_health`` says how)."""
        fleet = self._fleet
        timeout = self._fleet.config.timeouts.health_check_timeout
        async with trio.open_nursery() as nursery:
            for endpoint in list(fleet.endpoints.values()):
                nursery.start_soon(self._probe, endpoint, timeout)
        await self._ask_unverified(timeout)

        for pool in fleet.pools.values():
            if pool.queue.waiting and pool.keys_refused() is not None:
                pool.reroute_waiters()  # decided again now: 502 upstream_auth, not a queue timeout later
            pool.queue.dispatch()
        for endpoint in list(fleet.endpoints.values()):
            await endpoint.client.expire_idle()  # a pool that went quiet keeps no idle connections

    def newcomers(self) -> None:
        """Endpoints may have joined (a reload, DNS): probe the unknown ones now, not at the next turn."""
        self._newcomers.set()

    async def _probe_newcomers_forever(self) -> None:
        """An endpoint that joined takes requests once a probe passes: its first probe runs at once, and
        requests wait for its verdict (``Pool.admit``), never a whole health check interval."""
        while True:
            await self._newcomers.wait()
            self._newcomers = trio.Event()
            try:
                await self.probe_unknown()
            except Exception:  # a bad turn must not end the newcomers' probes
                log.exception("probing new endpoints failed")

    async def probe_unknown(self) -> None:
        """Probe every endpoint no probe has judged yet, concurrently; offer their pools' seats to the waiters."""
        fleet = self._fleet
        unknown = [e for e in fleet.endpoints.values() if not e.probed]
        if not unknown:
            return
        timeout = fleet.config.timeouts.health_check_timeout
        async with trio.open_nursery() as nursery:
            for endpoint in unknown:
                nursery.start_soon(self._probe, endpoint, timeout)
        for pool in fleet.pools.values():
            pool.queue.dispatch()

    async def _probe(self, endpoint: Endpoint, timeout: float) -> None:
        """One probe of ``endpoint``, judged against its pool's thresholds; a stall of this loop is no verdict.

        The probe is ``GET /health`` -- and ``GET /v1/models`` after it while
        tailguard's key is unproven or refused there (``_check_key``) -- or a one-token completion: always
        (``health_check = "completion"``), or (``"auto"``) in a turn where a
        call has waited a whole turn for its first byte and the engine sent no
        byte meanwhile -- what a half-dead engine (``/health`` fine, work hung)
        looks like; an engine that answers, or owes nothing, costs no completion.

        Two misses count at once, whatever ``unhealthy_threshold`` says: a
        refused connection (nothing listens on the engine's port: an answer,
        which no lost packet or stall of this loop can fake), and a probe
        that timed out while this loop was on time and the engine sent no
        byte on any call (silent: a black hole, or a half-dead engine). A
        silent engine's calls still waiting for their first byte give up at
        its second silent miss in a row, nothing heard since the first, and
        are tried elsewhere: an API server starved of CPU for a second or two
        while its engine runs only whole answers (no byte until each ends)
        looks silent once, and its calls are not given up for it. A probe that timed out while the engine was
        sending bytes elsewhere is a miss like any other (busy, not dead); a
        completion probe that did so while the endpoint ran its full cap
        waited in vLLM's own queue, and is no verdict; and one that timed out
        at the full cap with the engine silent is a miss (the probe may have
        waited for a seat there).
        """
        pool = self._fleet.pool_of(endpoint)
        started = trio.current_time()
        client, heard = endpoint.client, endpoint.client.heard
        completion = pool is not None and self._completion_probe(endpoint, pool.config.health_check)
        self._last_turn[endpoint] = (started, weakref.ref(client), heard)
        with trio.move_on_after(timeout):
            answer: Answer = None
            try:
                if pool is not None and completion:
                    answer = await endpoint.probe.completes(pool.config.models[0])
                    note_credentials(endpoint, None if answer == REFUSED else answer)
                else:
                    answer = await endpoint.probe.health()
                    if answer == 200 and key_unproven(endpoint):
                        await ask_key(endpoint)
            except Exception:  # one broken probe must not stop the others
                if endpoint.retired:
                    return  # a reload took it out (and closed its probe) meanwhile
                log.exception("endpoint %s: its health probe failed", endpoint.url)
            passed = _completion_verdict(endpoint, answer) if completion else answer == 200
            if completion and passed is not None:
                endpoint.work_unproven = not passed
            if passed and completion:
                endpoint.end_ejection()
            if passed is not None:
                self._silent.pop(endpoint, None)
            self._judge(endpoint, passed, at_once="its connection was refused" if answer == REFUSED else None)
            return
        self._timed_out(endpoint, timeout, started, client, heard, completion=completion)

    def _timed_out(self, endpoint: Endpoint, timeout: float, started: float, client: BackendClient, heard: int, *, completion: bool) -> None:
        """A probe that got no answer within ``timeout``: no verdict, a miss, or a silent miss (see ``_probe``)."""
        loop_lag = self._loop_lag
        if loop_lag.excuses(started, timeout):
            log.warning(
                "endpoint %s did not answer its health check in %.1f s, but tailguard's own loop stalled for %.2f s of it: not counted",
                endpoint.url, timeout, loop_lag.stalled_since(started),
            )  # fmt: skip
            return
        busy = endpoint.client is not client or client.heard != heard
        full = completion and endpoint.in_flight >= endpoint.seats
        if busy and full:
            log.info("endpoint %s: its completion probe waited %.1f s behind its full cap: not counted", endpoint.url, timeout)
            return
        silent = not busy and not full
        endpoint.work_unproven = endpoint.work_unproven or completion
        if endpoint.healthy:
            log.warning("endpoint %s did not answer its health check in %.1f s%s", endpoint.url, timeout, "" if silent else " (busy)")
        self._judge(endpoint, False, at_once=f"it sent nothing for {timeout:g} s" if silent else None)
        if not silent:
            self._silent.pop(endpoint, None)
            return
        before = self._silent.get(endpoint)
        if before is None or before[0]() is not client or client.heard != before[1]:
            self._silent[endpoint] = (weakref.ref(client), heard)  # the first silent miss: the calls wait on
            return
        given_up = endpoint.stop_waiting()
        if given_up:
            log.warning("endpoint %s is silent: %d calls waiting for its first byte are tried elsewhere", endpoint.url, given_up)

    def _completion_probe(self, endpoint: Endpoint, kind: HealthCheckKind) -> bool:
        """Whether this turn's probe of ``endpoint`` is a completion: always, never, or ("auto") while a call
        sent before the last turn still waits for its first byte there, the engine sent nothing since
        that turn, and a seat of its cap is free for the probe -- and, once one failed, until one passes
        (``/health`` never proves that work gets done)."""
        if kind != "auto":
            return kind == "completion"
        if endpoint.work_unproven:
            return True
        if endpoint.in_flight >= endpoint.seats:  # never one more than its cap (and vLLM would queue it)
            return False
        last = self._last_turn.get(endpoint)
        if last is None:
            return False
        at, client, heard = last
        return endpoint.waiting_since() <= at and endpoint.client is client() and endpoint.client.heard == heard

    def _judge(self, endpoint: Endpoint, passed: bool | None, *, at_once: str | None = None) -> None:
        """The endpoint's state after a probe that ``passed`` (None: no verdict); ``at_once``: why a miss needs no threshold."""
        pool = self._fleet.pool_of(endpoint)
        config = pool.config if pool is not None else None  # None: a reload took it out meanwhile
        down_at = PoolConfig.unhealthy_threshold if config is None else config.unhealthy_threshold
        up_at = PoolConfig.healthy_threshold if config is None else config.healthy_threshold
        was, known = endpoint.healthy, endpoint.probed
        streaks = self._health_streaks
        if passed is None:
            return
        if not known or (at_once is not None and not passed):
            # The first verdict stands alone (one pass brings up an engine never seen: Envoy's start-up rule).
            streaks.forget(endpoint)
            endpoint.judged(passed)
        else:
            endpoint.judged(streaks.judge(endpoint, was, passed, unhealthy_threshold=down_at, healthy_threshold=up_at))
        healthy = endpoint.healthy
        if not known:
            if healthy:
                log.info("endpoint %s passed its first health check: up", endpoint.url)
            else:
                log.warning("endpoint %s failed its first health check%s: down", endpoint.url, f" ({at_once})" if at_once else "")
        elif healthy and not was:
            log.info("endpoint %s is healthy again", endpoint.url)
        elif was and not healthy:
            if at_once is not None:
                log.warning("endpoint %s failed its health check (%s): down at once", endpoint.url, at_once)
            else:
                log.warning("endpoint %s failed its health check %d times in a row: down", endpoint.url, down_at)
        elif not passed and was:
            log.info("endpoint %s failed its health check (%d in a row; down at %d)", endpoint.url, streaks.streak(endpoint), down_at)

    async def _ask_unverified(self, timeout: float) -> None:
        """Ask every healthy endpoint kept out for its context length again (one health check turn)."""
        fleet = self._fleet

        async def ask(endpoint: Endpoint) -> None:
            with trio.move_on_after(timeout):
                try:
                    value = await endpoint.probe.max_model_len()
                except ModelLenUnknown as error:
                    log.debug("endpoint %s: no max_model_len yet: %s", endpoint.url, error)
                    return
                fleet.note_model_lens({endpoint.url: value})

        async with trio.open_nursery() as nursery:
            for endpoint in list(fleet.endpoints.values()):
                if endpoint.pool_name is not None and endpoint.healthy and not endpoint.fits_context:
                    nursery.start_soon(ask, endpoint)

def _completion_verdict(endpoint: Endpoint, answer: Answer) -> bool | None:
    """What a completion probe's answer says of the engine: 200 passed; 503 is vLLM's queue full (busy,
    no verdict); another 4xx came from a server that works but refuses the probe itself (a proxy that
    allows chat only, a model name it does not serve): passed, with a warning, rather than a pool taken
    down by its probe; 401/403 (the key) and anything else failed."""
    if answer == 503:
        return None
    if isinstance(answer, int) and 400 <= answer < 500 and answer not in (401, 403):
        if not endpoint.probe_refused:
            log.warning(
                "endpoint %s answers the completion probe with %d: it cannot tell a hung engine from a working one"
                " (check the pool's models, or set health_check = \"http\")", endpoint.url, answer,
            )  # fmt: skip
        endpoint.probe_refused = True
        return True
    return answer == 200


def _endpoint_grant(endpoint: Endpoint, pool: Pool) -> Callable[[int], None]:
    def apply(seats: int) -> None:
        endpoint.granted = seats
        pool.queue.dispatch()

    return apply


def _yielding_of(holder: Pool | Endpoint) -> Callable[[Yielding | None], None]:
    """Who waits for ``holder``'s seats on other replicas, as each sync finds it (``Pool.yield_freed_seat`` reads it)."""

    def apply(way: Yielding | None) -> None:
        holder.yielding = way

    return apply


async def _forever(what: str, turn: Callable[[], Awaitable[None]], interval: Callable[[], float]) -> None:
    """Run ``turn`` every ``interval()`` seconds; a failing turn is logged, never fatal."""
    while True:
        try:
            await turn()
        except Exception:
            log.exception("%s failed; trying again in %g s", what, interval())
        await trio.sleep(interval())
