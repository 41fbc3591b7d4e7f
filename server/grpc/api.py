"""The gRPC front end's server: grpc.aio with ``tailguard.v1.Completions``, health and reflection, run from Trio.

This module opens the port and runs it; the handlers are in ``service``, the
protobuf <-> OpenAI translation in ``translate``. Translation only. Handlers run in asyncio: they read the call's metadata,
hand the message to the Trio side (through ``grpc_bridge.TrioPortal``) and
render what comes back -- routing metadata, protobuf, or an error status
with retry hints in trailing metadata (``server/errors_map.py``). The Trio
side runs each call in a ``router.session`` (request id, key, deadline,
telemetry, the cap on open calls) and turns the backend's OpenAI JSON/SSE
into protobuf; a reply that is not a valid completion is BadBackendReply,
never OK with empty content. A caller's deadline or cancellation cancels the
Trio scope, which aborts the backend generation and releases the seat.

A flood must not starve the process, and every call must end in tailguard's
words (served, or RESOURCE_EXHAUSTED ``server_busy`` with its retry hint) and
be counted. grpc has silent answers of its own, each avoided here:

- core holds the calls the process has not picked up yet and cancels them
  (CANCELLED, no details) after ``grpc.server_max_unrequested_time_in_server``
  (30 s) or, past ``grpc.server.max_pending_requests``, answers them
  RESOURCE_EXHAUSTED itself: calls must be picked up well before either, which
  is what the gate is for (below);
- with its overload protection (on by default) chttp2 answers REFUSED_STREAM
  (UNAVAILABLE "Stream removed" at the client) to a stream its client was
  allowed to open, because streams already answered count against
  ``grpc.max_concurrent_streams`` until Python has let go of them: it is
  turned off, so the limit is HTTP/2's own, which clients keep to;
- grpc.aio's ``maximum_concurrent_rpcs`` answers RESOURCE_EXHAUSTED "Concurrent
  RPC limit exceeded!" without a retry hint or a trace here: not used.

So the defences are, in order:

- HTTP/2 itself: at most ``streams_bound(max_calls)`` streams on one
  connection; a client's further calls wait in the client, where they cost
  this process nothing and grpc cancels none of them;
- the gate (``gate``): a call over it is refused on the asyncio side at once,
  before it costs the router anything: no Trio hop, no session, no parse
  (``server_busy`` with its retry hint); its access-log line and metrics are
  posted to Trio after the answer, batched. Its limit is measured: it backs
  off while calls wait inside grpc to be picked up, and grows while it binds
  and none wait, between a floor of 64 and ``max_calls`` (less where the
  pools are small: twice what they can seat and queue, plus ``_ROOM_SLACK``:
  the Trio side would refuse those calls anyway, at twice the cost);
- a caller (its key's name, or without one its connection) most of whose
  calls in the last second were refused for overload is shed there too, by
  the SRE book's adaptive throttling (``router.quotas.shed``): about twice its
  accepted rate still reaches the router. A flood's refusals then cost what
  grpc itself costs: without it each went through the Trio side, at ~2.5x
  the CPU of a server that refuses everything (``bench chaos``, the gRPC
  flood, and its floor);
- core's pending bound is far above what one connection's streams can hold,
  so core never answers a call the process would have answered;
- what the asyncio side hands Trio is run in bounded slices
  (``grpc_bridge``), so a burst of calls cannot stall the Trio loop, whose
  lateness the router measures (``router.observe.loop_lag``) and never blames on the
  engines.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, NoReturn

import grpc
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2 as reflection_v1alpha_pb2

from tailguard.router import Router
from tailguard.router.config import TlsConfig, read_pem
from tailguard.router.observe import Telemetry

from .bridge import AsyncioHost, TrioPortal
from .gate import Backlog
from .gen.grpc.reflection.v1 import reflection_pb2 as reflection_v1_pb2
from .health import Health
from .service import MAX_CONCURRENT_CALLS as MAX_CONCURRENT_CALLS, SERVICE_NAME, CompletionsService, Observers as Observers, add_completions

log = logging.getLogger("tailguard.grpc")

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAMES = (reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name, reflection.SERVICE_NAME)
GRACE_SECONDS = 5.0
# How often the Trio side looks at the router's readiness for the health service.
HEALTH_CHECK_SECONDS = 0.25


def streams_bound(max_calls: int) -> int:
    """Streams one HTTP/2 connection may hold open: ``max_calls`` served, as many again answered RESOURCE_EXHAUSTED."""
    return max_calls + max(max_calls, 100)



def pending_bound(max_calls: int) -> int:
    """Calls grpc core may hold before the process picks them up: more than five connections' full streams.

    Beyond it core answers calls itself (RESOURCE_EXHAUSTED, no retry hint, no
    trace here), so it is generous; what keeps calls from waiting long in
    core is the gate, not this bound.
    """
    return max(10 * max_calls, 10_000)


def server_options(max_calls: int) -> list[tuple[str, int]]:
    """grpc core's options for the front end's transport (see the module's docstring); ``bench.chaos``'s floor uses them too."""
    pending = pending_bound(max_calls)
    return [
        # Calls core holds that the process has not picked up yet: beyond the
        # bound core answers them itself, so it is far above what the streams
        # of a few connections can bring.
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
        # Streams on one connection: the cap, and as many again refused at
        # once; a client queues the rest itself, where they cost nothing here.
        ("grpc.max_concurrent_streams", streams_bound(max_calls)),
        # With it on (grpc's default) a stream answered but not yet let go of
        # by Python still counts against that limit, so a client that keeps to
        # it is refused anyway (REFUSED_STREAM: UNAVAILABLE, unseen here).
        ("grpc.http.overload_protection", 0),
    ]


# -- the server's lifecycle ----------------------------------------------------------


def enable_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection under both its names, ``grpc.reflection.v1`` and ``v1alpha``.

    grpcurl and Postman ask for v1 first; grpcio-reflection implements only
    v1alpha. The two protocols' messages are the same on the wire (field for
    field; only the package differs), so grpcio-reflection's servicer answers
    both: it is registered under each service name with v1alpha's codecs.
    v1's proto is vendored (``proto/grpc/reflection/v1``) so that its
    descriptor is in the pool and a client can describe every service listed.
    """
    servicer = reflection.aio.ReflectionServicer((*services, *REFLECTION_SERVICE_NAMES))
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method}) for name in REFLECTION_SERVICE_NAMES]
    )


class GrpcTls:
    """The gRPC listener's certificate, key and client CA, replaceable while it serves.

    grpc's dynamic credentials ask :meth:`_fetch` for a new configuration at
    every handshake, from grpc's own threads: a reload's new files are
    offered once (under a lock) and serve every connection after it;
    connections already open keep theirs. Whether client certificates are
    required is fixed when the port opens (``server.grpc_tls`` on or off,
    with or without ``client_ca_file``, needs a restart).
    """

    def __init__(self, tls: TlsConfig) -> None:
        self.require_client_auth = tls.client_ca_file is not None
        self._initial = self.configuration(tls)
        self._lock = threading.Lock()
        self._offered: Any = None

    @staticmethod
    def configuration(tls: TlsConfig) -> Any:
        """grpc's certificate configuration from the files as they are now (raises ``TlsFileError``)."""
        pem = read_pem(tls)
        return grpc.ssl_server_certificate_configuration([(pem.private_key, pem.cert_chain)], root_certificates=pem.client_ca)

    def offer(self, configuration: Any) -> None:
        """New connections get ``configuration`` (one from :meth:`configuration`)."""
        with self._lock:
            self._offered = configuration

    def credentials(self) -> Any:
        return grpc.dynamic_ssl_server_credentials(self._initial, self._fetch, require_client_authentication=self.require_client_auth)

    def _fetch(self) -> Any:
        """grpc's question at a handshake: a new configuration, or None to keep the one it has."""
        with self._lock:
            offered, self._offered = self._offered, None
        return offered


class GrpcServer:
    """The grpc.aio server with tailguard's service, health and reflection (asyncio side)."""

    def __init__(
        self,
        router: Router,
        portal: TrioPortal,
        observers: Observers,
        *,
        max_calls: int = MAX_CONCURRENT_CALLS,
        reuse_port: bool = False,
        tls: GrpcTls | None = None,
    ) -> None:
        self._router = router
        self._portal = portal
        self._observers = observers
        self._max_calls = max_calls
        self._reuse_port = reuse_port
        self._tls = tls
        self._server: grpc.aio.Server | None = None
        self._service: CompletionsService | None = None
        self._follow: asyncio.Task[NoReturn] | None = None
        self._health = Health()

    async def start(self, host: str, port: int) -> int:
        servers_before = Backlog.server_ids()
        server = grpc.aio.server(options=[*server_options(self._max_calls), ("grpc.so_reuseport", int(self._reuse_port))])  # on only for --workers
        service = self._service = CompletionsService(self._router, self._portal, self._observers, max_calls=self._max_calls)
        add_completions(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(server, (SERVICE_NAME, HEALTH_SERVICE_NAME))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound: int = server.add_insecure_port(address) if self._tls is None else server.add_secure_port(address, self._tls.credentials())
        if not bound:
            raise OSError(f"gRPC could not listen on {address}")
        backlog = Backlog.around(servers_before)
        await server.start()
        self._server = server
        self._follow = asyncio.get_running_loop().create_task(service.follow(backlog), name="grpc-gate")
        return bound

    async def set_serving(self, serving: bool) -> None:
        """The health service's answer, for the whole server and for the completions service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def set_room(self, room: int) -> None:
        """What the pools can seat and queue now, for the completions service's gate."""
        if self._service is not None:
            self._service.set_room(room)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish up to ``grace`` s, then cancel them.

        Health watchers are told NOT_SERVING and their streams end first
        (server/grpc/health.py): an idle server stops at once.
        """
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self._follow is not None:
            self._follow.cancel()


async def serve_grpc(
    router: Router,
    host: AsyncioHost,
    listen: tuple[str, int],
    shutdown: trio.Event,
    observers: Observers | None = None,
    *,
    max_calls: int = MAX_CONCURRENT_CALLS,
    reuse_port: bool = False,
    tls: GrpcTls | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """From Trio: run the gRPC server until ``shutdown``; reports the bound port.

    ``max_calls`` bounds the completion calls open at once (see the module's
    docstring); with ``tls`` the port speaks TLS only.
    """
    async with trio.open_nursery() as calls:
        grpc_server = GrpcServer(
            router, TrioPortal(calls, host.loop), observers or Observers(Telemetry([router.judge])), max_calls=max_calls, reuse_port=reuse_port, tls=tls
        )
        port = await host.run(lambda: grpc_server.start(*listen))
        shown = "" if tls is None else " (TLS, client certificates required)" if tls.require_client_auth else " (TLS)"
        log.info("gRPC listening on %s:%s%s", listen[0], port, shown)
        await calls.start(_push_state, router, host, grpc_server)
        task_status.started(port)
        await shutdown.wait()
        with trio.CancelScope(shield=True):
            await host.run(lambda: grpc_server.stop(GRACE_SECONDS))
        calls.cancel_scope.cancel()


async def _push_state(
    router: Router, host: AsyncioHost, grpc_server: GrpcServer, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Tell the asyncio side when readiness or the pools' room changes (and only then).

    Both are read on the Trio side, where the router lives, every
    ``HEALTH_CHECK_SECONDS``; the asyncio side hears of a change, not of
    every check.
    """
    serving = router.health()["status"] != "unavailable"
    await host.run(lambda: grpc_server.set_serving(serving))
    room = router.room()
    await host.run(lambda: grpc_server.set_room(room))
    task_status.started()
    while True:
        await trio.sleep(HEALTH_CHECK_SECONDS)
        now_serving = router.health()["status"] != "unavailable"
        if now_serving != serving:
            serving = now_serving
            await host.run(lambda: grpc_server.set_serving(now_serving))
        now_room = router.room()
        if now_room != room:
            room = now_room
            await host.run(lambda: grpc_server.set_room(now_room))
