"""The router's facade: the one object the front ends and tests hold.

It owns no logic of its own; each job is a module of its own:
router/admission/admit.py and router/request_path.py (a request, from caps to the
relayed body), router/fleet/reconcile.py (endpoints and pools, reconciled with the
file, DNS and rebalancing), router/upkeep.py (the background loops) and
router/views.py (statistics, /health, the assignment).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from .admission import RouterRequest
from .config import Config
from .fleet import Discovery, Endpoint, Fleet, Found, Pool, TransportFactory
from .observe import Attainment, ClassAttainment, LoopLag, RequestRecord
from .quotas import ANONYMOUS, Authenticator, Caller, LedgerStore, Traffic
from .request_path import Completion, RequestPath
from .upkeep import Upkeep
from .utility import UtilityAnswer, UtilityCalls
from .views import EndpointStatistics, RouterStatistics, assignment, endpoint_statistics, health, models, statistics

__all__ = ["Completion", "EndpointStatistics", "Router", "RouterStatistics", "TransportFactory", "UtilityAnswer"]


class Router:
    """Classifies, caps, queues and routes requests over the configured pools."""

    def __init__(
        self,
        config: Config,
        *,
        transport_factory: TransportFactory | None = None,
        seed: int | None = None,
        model_lens: Mapping[str, int | None] | None = None,
    ) -> None:
        """``model_lens``: what endpoints reported in GET /v1/models (router/fleet/model_len.py's ``Asked.reported``)."""
        self._fleet = fleet = Fleet(config, transport_factory or (lambda _: None), random.Random(seed), model_lens or {})
        self._traffic = Traffic()
        self._path = RequestPath(fleet, self._traffic)
        self._utility = UtilityCalls(fleet, self._path.homes)
        self._authenticator = Authenticator(config.auth)
        self._attainment = Attainment()
        self.loop_lag = LoopLag()  # how late this loop runs: verdicts about engines discount its stalls (read-only outside)
        self.discovery = Discovery(self)
        self._upkeep = Upkeep(fleet, self.loop_lag, self.discovery, lambda: self._path.forget_idle(self.caller_names))
        self.apply(config)

    @property
    def config(self) -> Config:
        """The config file in force now (``apply`` swaps it)."""
        return self._fleet.config

    # -- configuration ------------------------------------------------

    def apply(self, config: Config) -> None:
        """Swap to a validated config at once (synchronously: no request sees half of it).

        All or nothing: everything that can fail (new endpoints and their
        clients) is built first, then the swap changes plain fields only. If
        building raises, nothing has changed.

        Endpoints are kept by URL, pools by name, so in-flight counts carry
        over: a moved endpoint's running requests finish where they started
        and still count against its cap. A removed endpoint is retired: no
        new requests, its client closed when its last seat is released.

        A pool's endpoints from DNS (``endpoints_dns``) stay as last resolved,
        under the new file's caps, and discovery resolves again at once.
        """
        self._fleet.apply(config)
        self._authenticator = Authenticator(config.auth)
        self._attainment.forget(klass.name for klass in config.classes)
        self._path.service.forget({klass.name for klass in config.classes})
        self.discovery.wake()  # a reload resolves the pools' DNS names again at once
        self._upkeep.newcomers()  # a new endpoint is unknown, and probed at once

    def replace_discovered(self, pool_name: str, found: Sequence[Found]) -> None:
        """One pool's endpoints from DNS are now ``found`` (router/fleet/discovery.py calls this each round).

        The difference is applied as a reload applies it: a new address is
        a new endpoint with its entry's cap; a vanished one is retired (its
        running requests finish and still count against its cap, its client
        closes with its last seat); one that comes back while those run gets
        that same endpoint and count. The pool's own cap does not change,
        so it holds through the change. All or nothing, like ``apply``.
        """
        self._fleet.replace_discovered(pool_name, found)
        self._upkeep.newcomers()

    def note_model_lens(self, reported: Mapping[str, int | None]) -> None:
        """What endpoints just reported in GET /v1/models (a reload's round of asking); kept for endpoints to come."""
        self._fleet.note_model_lens(reported)

    # -- admitting ----------------------------------------------------

    def drain(self) -> None:
        """Stop admitting: new requests get 503 with Retry-After, /health turns unready."""
        self._traffic.draining = True

    @property
    def draining(self) -> bool:
        return self._traffic.draining

    async def wait_idle(self) -> None:
        """Return once no request is inside :meth:`open` (queued or running)."""
        await self._traffic.idle.wait()

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header names (anonymous when auth is off).

        Raises Unauthenticated for a missing or unknown key while keys are configured.
        """
        return self._authenticator.authenticate(authorization)

    def deadline_for(self, request: RouterRequest, arrival: float | None = None) -> float:
        """The request's end-to-end deadline: the configured one or the caller's, if sooner."""
        return self._path.deadline_for(request, arrival)

    @property
    def caller_names(self) -> frozenset[str]:
        """Every caller a request may be now: the keys' names, or "anonymous" when auth is off."""
        return self._authenticator.names

    @property
    def caller_in_flight(self) -> Mapping[str, int]:
        """Callers with requests queued or running now, and how many (read-only)."""
        return self._traffic.caller_in_flight

    def open(
        self,
        request: RouterRequest,
        *,
        arrival: float | None = None,
        caller: Caller = ANONYMOUS,
        record: RequestRecord | None = None,
    ) -> AbstractAsyncContextManager[Completion]:
        """Admit the request and open its backend response (``async with``).

        Raises (before yielding) any RequestRejected or Overloaded error, or
        BackendError when the backend refuses or cannot be reached. ``record``
        (made by the front end) receives the decisions and timestamps.
        """
        return self._path.open(request, arrival, caller, record)

    async def utility(self, path: str, payload: Mapping[str, object], headers: Mapping[str, str]) -> UtilityAnswer:
        """A call that generates nothing (tokenize, detokenize, count tokens), relayed without a seat (router/utility.py)."""
        return await self._utility.call(path, payload, headers)

    async def at_response_home(self, response_id: str, method: str, path: str, body: bytes | None) -> UtilityAnswer:
        """A stored Responses API response's lookup or cancellation, on the engine that keeps it (router/utility.py)."""
        return await self._utility.at_home(response_id, method, path, body)

    # -- background work --------------------------------------------------

    async def run(self, *, ledger: LedgerStore | None = None, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background work, forever: health checks (``healthy`` is set only from
        here), backend load scrapes, closing clients that reloads retired,
        rebalancing, forgetting per-caller state that can no longer matter, and -- with ``[cluster]`` and a ``ledger`` -- keeping this
        replica's share of every cap in step with the others (the first sync,
        or the fallback, happens before ``started``).

        A turn that fails is logged and the loop goes on: a broken probe must
        never stop health checking for the life of the process.
        """
        await self._upkeep.run(ledger, task_status)

    def rebalance_turn(self, nursery: trio.Nursery) -> None:
        """One look; a move that is due starts now and finishes in ``nursery``."""
        self._upkeep.rebalance_turn(nursery)

    async def check_health(self) -> None:
        """Probe every endpoint once, concurrently; wake waiters on recovery.

        An endpoint is unknown, and takes no request, until a probe has
        passed (requests to a pool with none judged yet wait for the verdict,
        within their queue deadline): ``tailguard serve`` runs this once
        before it listens, and a test that sends at once awaits it first.
        A refused connection, and a probe that timed out while this loop
        was on time and the engine sent nothing, mark an endpoint down at
        once (the engine's calls still waiting for a first byte are then
        tried elsewhere); other misses count towards the threshold.

        A pool's ``health_check`` picks the probe: ``GET /health``, or a
        one-token completion, which also proves the engine can work (and so
        ends an ejection at once). An endpoint goes down after the pool's
        ``unhealthy_threshold`` failed probes in a row and up after
        ``healthy_threshold`` passed ones; a probe that timed out while this
        loop stalled (``LoopLag.excuses``) is no verdict. Every turn also re-offers each pool's
        seats to its waiters, since ejections run out by themselves, and
        closes keep-alive connections that have been idle too long.
        """
        await self._upkeep.check_health()

    async def aclose(self) -> None:
        fleet = self._fleet
        for endpoint in [*fleet.endpoints.values(), *fleet.retired.values()]:
            await endpoint.aclose()
        await self._upkeep.close_retired()

    # -- views ------------------------------------------------------------

    @property
    def pools(self) -> Mapping[str, Pool]:
        """The pools by name now (read-only: ``apply`` and rebalancing change them)."""
        return self._fleet.pools

    def pool(self, name: str) -> Pool:
        """The pool named ``name`` now (KeyError if the file has none)."""
        return self._fleet.pools[name]

    @property
    def endpoints(self) -> Iterable[Endpoint]:
        """Every endpoint in some pool or moving between two now (not the retired ones still finishing)."""
        return self._fleet.endpoints.values()

    def endpoint(self, url: str) -> Endpoint:
        """The endpoint at ``url`` now (KeyError if none)."""
        return self._fleet.endpoints[url]

    def endpoint_statistics(self, url: str) -> EndpointStatistics:
        """One endpoint as :meth:`statistics` shows it (its pool "" while a rebalancing move drains it)."""
        endpoint = self._fleet.endpoints[url]
        return endpoint_statistics(endpoint, "" if endpoint.pool_name is None else endpoint.pool_name)

    def statistics(self) -> RouterStatistics:
        path = self._path
        return statistics(
            self._fleet,
            self._traffic,
            path.budgets_left(),
            budget_callers=path.budget_callers,
            ledger_keys=path.ledger_keys,
            prompt_ratios=path.prompt_ratios(),
        )

    def judge(self, record: RequestRecord) -> None:
        """Telemetry sink, before the others: whether a finished request met its class's objective (``record.objective_met``),
        and how long it held its seat (the class's service time, which its queue deadline reads)."""
        klass = next((klass for klass in self._fleet.config.classes if klass.name == record.request_class), None)
        self._attainment.observe(record, klass)
        self._path.service.observe(record, klass)

    def attainment(self) -> tuple[ClassAttainment, ...]:
        """Each class's share of requests that met its objective, over the last minute and in total."""
        try:
            now: float | None = trio.current_time()
        except RuntimeError:  # read outside the event loop (a scrape in a test's thread): as the last verdict left it
            now = None
        return self._attainment.view(self._fleet.config.classes, now)

    def room(self) -> int:
        """Requests all pools could hold at once, seated or waiting (``Pool.room``): beyond it a newcomer is refused, or displaces a less urgent waiter."""
        return sum(pool.room for pool in self._fleet.pools.values())

    def health(self) -> dict[str, Any]:
        """Ready only when every pool has a healthy endpoint; says which are not."""
        return health(self._fleet, self._traffic.draining)

    def assignment(self) -> list[dict[str, Any]]:
        """Each pool's GPUs now, for ``/v1/limits`` (no URLs): rebalancing and lending show here."""
        return assignment(self._fleet)

    def models(self) -> dict[str, int]:
        """Each model served, with the context length a caller may size prompts to (``/v1/models``' max_model_len)."""
        return models(self._fleet.config)

