"""The process: one nursery holding the router, its front end, reload and shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import trio

from tailguard.router import Router
from tailguard.router.config import Config, ConfigError, ServerConfig, TlsConfig, TlsFileError, server_context
from tailguard.router.fleet import ModelLenError, ask_model_lens
from tailguard.router.observe import RepeatedIds, Telemetry

from .grpc.api import GrpcTls, Observers, serve_grpc
from .grpc.bridge import AsyncioHost, open_asyncio_host
from .http.api import HttpApi
from .http.server import HttpSettings, ServerTls, serve as serve_http
from .logs import AccessLog
from .metrics import Metrics
from .redis_ledger import RedisLedger
from .reload import ConfigReloader, Prepare
from .simulate import SimulatedFleet, SimulateError, lone_os_error, wait_for_engines
from .trace_switch import TracingSwitch
from .workers import WorkerRole

log = logging.getLogger("tailguard")

_T = TypeVar("_T")


class StartupError(Exception):
    """Something the operator must fix before tailguard can serve; the CLI prints it in one line and exits 2."""


class ListenError(StartupError):
    """An address tailguard must listen on cannot be bound (in use, not this host's, not allowed).

    ``key`` says where the address comes from -- ``server.http_listen``,
    ``server.grpc_listen``, or a ``--simulate`` endpoint's URL -- so the
    message names what to change.
    """

    def __init__(self, address: str, key: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address} ({key}): {reason}")
        self.address, self.key, self.reason = address, key, reason


@dataclass(frozen=True)
class Running:
    """What ``serve`` reports once it is listening (tests use it).

    Setting ``drain`` does what SIGTERM does: stop admitting, let in-flight
    requests finish up to ``timeouts.drain_timeout``, then shut down.
    """

    router: Router
    http_url: str
    reloader: ConfigReloader | None
    metrics: Metrics
    drain: trio.Event
    grpc_port: int | None = None
    metrics_url: str | None = None  # [server] metrics_listen's, when /metrics has a listener of its own


class ListenersTls:
    """The listeners' TLS as running: built at start, rebuilt when a reload changes a file.

    HTTP's context is swapped whole (on, off or new files; new connections
    get it); gRPC's certificates through grpc's dynamic credentials, its
    on/off fixed at start (``server.grpc_tls`` is restart-only).
    """

    def __init__(self, server: ServerConfig) -> None:
        self._http_config = server.http_tls
        self._grpc_config = server.grpc_tls
        self.http = ServerTls(None if server.http_tls is None else _loaded("http_tls", server.http_tls, server_context))
        self.grpc = None if server.grpc_tls is None else _loaded("grpc_tls", server.grpc_tls, GrpcTls)

    def prepare(self, server: ServerConfig) -> Callable[[], None]:
        """Read a reloaded config's files now (a :exc:`ConfigError` if one fails); returns the swap."""
        http_config, grpc_config = server.http_tls, server.grpc_tls
        swaps: list[Callable[[], None]] = []
        if http_config != self._http_config:
            context = None if http_config is None else _loaded("http_tls", http_config, server_context)
            swaps.append(lambda: setattr(self.http, "context", context))
        grpc = self.grpc
        if grpc is not None and grpc_config is not None and grpc_config != self._grpc_config:
            offered = _loaded("grpc_tls", grpc_config, GrpcTls.configuration)
            swaps.append(lambda: grpc.offer(offered))

        def swap() -> None:
            for one in swaps:
                one()
            self._http_config, self._grpc_config = http_config, grpc_config

        return swap


def _loaded(name: str, tls: TlsConfig, load: Callable[[TlsConfig], _T]) -> _T:
    """``load(tls)``; a file that fails is a :exc:`ConfigError` naming its dotted key."""
    try:
        return load(tls)
    except TlsFileError as error:
        raise ConfigError([f"server.{name}.{error.key}: {error.message}"], source="the TLS files") from None


# Requests still in flight when the router's drain is over get this long to
# send their last bytes; then their connections are closed.
_HTTP_GRACE_SECONDS = 5.0


async def serve(
    config: Config,
    config_path: Path | None,
    *,
    simulate: bool = False,
    http_port: int | None = None,
    grpc: bool = False,
    grpc_port: int | None = None,
    shutdown: trio.Event | None = None,
    worker: WorkerRole | None = None,
    prepare: Prepare | None = None,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run tailguard until ``shutdown`` is set, or a drain (SIGTERM, SIGINT) ends.

    With ``grpc`` the gRPC front end runs too (grpc.aio, on an asyncio loop
    of its own thread: ``server/grpc/bridge.py``). As one of several
    ``worker`` processes (``server/workers.py``) it shares the ports with the
    others and also serves on a port of its own; with ``simulate``, worker 0
    starts the engines and the others wait for them (bounded) before asking
    them anything. ``http_port``/``grpc_port`` override the configured ports (0
    picks a free one). Signals are handled only on the main thread.
    ``prepare`` is what the caller did to the file's config (command-line
    overrides, a worker's share): reloads do it to the new file too.

    Raises :exc:`ListenError` (in an exception group) when an address cannot
    be bound, and :exc:`StartupError` for a config ``--simulate`` cannot serve
    or a pool whose ``max_model_len`` is neither set nor reported by an endpoint.
    """
    shutdown = trio.Event() if shutdown is None else shutdown
    drain = trio.Event()
    tls = _starting(config, config_path)
    # The ledger's connections (a task group of coredis's) open before the nursery and close after it.
    ledger_context: contextlib.AbstractAsyncContextManager[RedisLedger | None] = (
        RedisLedger(config.cluster.redis_url, config.cluster.namespace) if config.cluster is not None else contextlib.nullcontext()
    )
    async with ledger_context as ledger, trio.open_nursery() as nursery:
        fleet = await _start_fleet(nursery, config) if simulate and _runs_engines(worker) else None
        engines_elsewhere = simulate and fleet is None
        if engines_elsewhere:
            await _wait_for_engines(config)
        router, config = await _start_router(nursery, config, ledger)
        services = await _start_services(nursery, router, config, fleet, tls, engines_elsewhere)
        reloader = await _start_reloads(nursery, services, config, config_path, prepare, drain, shutdown)
        metrics_listen = config.server.metrics_listen
        app = HttpApi(
            router,
            max_body_bytes=config.server.max_body_bytes,
            telemetry=services.telemetry,
            metrics=services.metrics,
            repeated_ids=services.repeated_ids,
            access_log=services.access_log,
            tracing=services.tracing,
            serves="all" if metrics_listen is None else "api",
        )
        await nursery.start(app.run)  # background work: cancelled once the servers below are done
        # The HTTP server returns once the shutdown trigger fired and its
        # in-flight requests finished (or its grace period passed); the rest
        # of the nursery is background work, cancelled after it.
        async with contextlib.AsyncExitStack() as front_stack, trio.open_nursery() as front:
            # gRPC first (its server takes ~1 s to start): once HTTP answers /health, both front ends take calls,
            # so a readiness probe on /health never sends gRPC callers to a port that refuses them.
            bound_grpc: int | None = None
            port = config.server.http_port if http_port is None else http_port
            if grpc:  # a busy HTTP address is said before gRPC runs (a server left unstopped cannot exit quietly)
                _check_bindable(config.server.http_host, port, "server.http_listen", reuse_port=worker is not None)
                if metrics_listen is not None:
                    _check_bindable(*metrics_listen, "server.metrics_listen", reuse_port=worker is not None)
                asyncio_host = await front_stack.enter_async_context(open_asyncio_host())
                listen = (config.server.grpc_host, config.server.grpc_port if grpc_port is None else grpc_port)
                bound_grpc = await _serve_grpc_port(front, asyncio_host, listen, services, config.server, tls, worker, shutdown)
            address = await _serve_http_ports(
                front, app, (config.server.http_host, port), "server.http_listen", config.server, tls.http, worker, shutdown
            )
            metrics_url = None
            if metrics_listen is not None:  # plain HTTP, /metrics alone: Prometheus's port, not the callers'
                scrape = HttpApi(router, max_body_bytes=1024, telemetry=services.telemetry, metrics=services.metrics, serves="metrics")
                metrics_url = await _serve_http_ports(front, scrape, metrics_listen, "server.metrics_listen", config.server, None, worker, shutdown)
            _tune_gc()
            _return_big_buffers()
            task_status.started(Running(router, address, reloader, services.metrics, drain, bound_grpc, metrics_url))
        nursery.cancel_scope.cancel()
    await router.aclose()
    services.metrics.close()


def _starting(config: Config, config_path: Path | None) -> ListenersTls:
    """Log what was loaded and its warnings; the listeners' TLS, read again for the servers."""
    if config_path is not None:
        log.info("config loaded from %s (digest %s)", config_path.absolute(), config.digest)
    for warning in config.warnings:
        log.warning("config: %s", warning)
    try:  # the files were checked with the config; read them again for the servers
        return ListenersTls(config.server)
    except ConfigError as error:
        raise StartupError("; ".join(error.problems)) from None


async def _start_fleet(nursery: trio.Nursery, config: Config) -> SimulatedFleet:
    """``--simulate``: the engines of ``config``'s endpoints, serving before the router asks them anything."""
    fleet = SimulatedFleet(nursery)
    try:
        await fleet.ensure(config)
    except SimulateError as error:
        if error.address is None:
            raise StartupError(str(error)) from None
        raise ListenError(error.address, f"--simulate endpoint {error.url}", error.reason) from None
    return fleet


# How long a worker waits for the engines worker 0 simulates: worker 0's own start
# (an interpreter, its imports, the engines) with room to spare on a loaded host.
_ENGINES_WAIT = 30.0


def _runs_engines(worker: WorkerRole | None) -> bool:
    """Under ``--simulate``: whether this process starts the engines (alone, or worker 0) or another worker does."""
    return worker is None or worker.index == 0


async def _wait_for_engines(config: Config) -> None:
    """A worker other than 0 under ``--simulate``: wait for worker 0's engines before asking them anything."""
    missing = await wait_for_engines(config, _ENGINES_WAIT)
    if missing:  # asked anyway: the pools that need an answer say what is missing
        log.warning("--simulate: worker 0's engines at %s do not listen after %g s", ", ".join(missing), _ENGINES_WAIT)


async def _start_router(nursery: trio.Nursery, config: Config, ledger: RedisLedger | None) -> tuple[Router, Config]:
    """The router, its endpoints checked and its upkeep running; and the config with the engines' context lengths."""
    try:  # pools without max_model_len ask their engines (at once, bounded)
        asked = await ask_model_lens(config)
    except ModelLenError as error:
        raise StartupError(str(error)) from None
    config = asked.config
    router = Router(config, model_lens=asked.reported)
    await router.check_health()
    if config.cluster is not None:
        # One admission budget with the other replicas: the ledger lives as long as the process.
        await nursery.start(functools.partial(router.run, ledger=ledger))
        log.info("cluster: replica %s shares its caps through %s", config.cluster.replica(), _redacted(config.cluster.redis_url))
    else:
        await nursery.start(router.run)  # endpoints from DNS are resolved before serving
    return router, config


@dataclass
class _Services:
    """What runs around the router: built at start, and what a reload applies a new config to."""

    router: Router
    fleet: SimulatedFleet | None
    tls: ListenersTls
    metrics: Metrics
    access_log: AccessLog
    telemetry: Telemetry
    repeated_ids: RepeatedIds
    tracing: TracingSwitch
    engines_elsewhere: bool = False  # --simulate, and another worker runs the engines

    async def resolve(self, new: Config) -> Config:
        """A reloaded file's pools without max_model_len ask their engines (simulated ones started, or waited for, first)."""
        if self.fleet is not None:
            await self.fleet.ensure(new)
        if self.engines_elsewhere:  # worker 0 reloads the same file at the same time and starts the new ones
            await _wait_for_engines(new)
        found = await ask_model_lens(new)
        self.router.note_model_lens(found.reported)
        return found.config

    async def apply(self, new: Config) -> None:
        swap_tls = self.tls.prepare(new.server)  # first: a TLS file that fails refuses the reload whole
        if self.fleet is not None:
            await self.fleet.ensure(new)
        self.tracing.apply(new.tracing)
        self.router.apply(new)
        self.access_log.enabled, self.access_log.log_prompts = new.logging.access_log, new.logging.log_prompts
        self.repeated_ids.window = new.metrics.duplicate_request_id_window
        logging.getLogger().setLevel(new.logging.level.upper())
        for warning in new.warnings:
            log.warning("config: %s", warning)
        swap_tls()
        if self.fleet is not None:  # last: the engines of endpoints the applied config dropped
            await self.fleet.retire(new)


async def _start_services(
    nursery: trio.Nursery, router: Router, config: Config, fleet: SimulatedFleet | None, tls: ListenersTls, engines_elsewhere: bool
) -> _Services:
    """Metrics, the access log, repeated-id detection and tracing, for both front ends."""
    metrics = Metrics(router)
    access_log = AccessLog(log_prompts=config.logging.log_prompts, enabled=config.logging.access_log)
    telemetry = Telemetry([router.judge, metrics.observe, access_log])  # judged first: the others show the verdict
    repeated_ids = RepeatedIds(config.metrics.duplicate_request_id_window)
    # [tracing]: off, the OpenTelemetry SDK is not even imported; a reload switches it live.
    try:
        tracing = TracingSwitch(config.tracing, grace=lambda: router.config.timeouts.end_to_end_timeout)
    except ConfigError as error:  # on, without the `tracing` extra's exporter installed
        raise StartupError("; ".join(error.problems)) from None
    await nursery.start(tracing.run)
    return _Services(router, fleet, tls, metrics, access_log, telemetry, repeated_ids, tracing, engines_elsewhere)


async def _start_reloads(
    nursery: trio.Nursery,
    services: _Services,
    config: Config,
    config_path: Path | None,
    prepare: Prepare | None,
    drain: trio.Event,
    shutdown: trio.Event,
) -> ConfigReloader | None:
    """Reloads on SIGHUP and on a change of the file, and the drain on SIGTERM/SIGINT (signals on the main thread only)."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    reloader = (
        ConfigReloader(config_path, config, services.apply, on_result=services.metrics.reloaded, prepare=prepare, resolve=services.resolve)
        if config_path is not None
        else None
    )
    if reloader is not None:
        if on_main_thread:
            await nursery.start(reloader.watch_signals)
        nursery.start_soon(reloader.watch_file)  # polls every reload_poll_interval s, as the running config says
    if on_main_thread:
        nursery.start_soon(_drain_on_signals, drain, shutdown)
    nursery.start_soon(_drain_then_stop, services.router, drain, shutdown)
    return reloader


async def _serve_http_ports(
    front: trio.Nursery,
    app: HttpApi,
    listen: tuple[str, int],
    key: str,
    server: ServerConfig,
    tls: ServerTls | None,
    worker: WorkerRole | None,
    shutdown: trio.Event,
) -> str:
    """An HTTP port (shared with the other workers, if any) and a worker's own; returns the shared one's URL.

    ``key`` names the address in a bind's error (``server.http_listen``, ``server.metrics_listen``).
    """
    settings = HttpSettings.from_config(server, grace_timeout=_HTTP_GRACE_SECONDS)
    if worker is not None:
        settings = dataclasses.replace(settings, reuse_port=True)
    host, port = listen
    binds = await _bound(
        host, port, key,
        front.start(functools.partial(
            serve_http, app, host, port, settings=settings, shutdown_trigger=shutdown.wait, tls=tls, on_refusal=app.refused,
        )),
    )
    if worker is not None:  # this worker alone answers here: Prometheus scrapes each worker
        own = await _bound(
            host, worker.own_port(port), f"worker {worker.index}'s own port: {key}'s + {1 + worker.index}",
            front.start(
                functools.partial(
                    serve_http, app, host, worker.own_port(port), settings=HttpSettings.from_config(
                        server, grace_timeout=_HTTP_GRACE_SECONDS
                    ), shutdown_trigger=shutdown.wait, tls=tls, on_refusal=app.refused,
                )
            ),
        )
        log.info("worker %d of %d: its own %s on %s", worker.index, worker.count, "metrics" if app.serves == "metrics" else "metrics and API", own[0])
    log.info("tailguard %s on %s", "serves /metrics" if app.serves == "metrics" else "listening", binds[0])
    return binds[0]


async def _serve_grpc_port(
    front: trio.Nursery,
    asyncio_host: AsyncioHost,
    listen: tuple[str, int],
    services: _Services,
    server: ServerConfig,
    tls: ListenersTls,
    worker: WorkerRole | None,
    shutdown: trio.Event,
) -> int:
    """The gRPC port on ``asyncio_host``; returns the port bound."""
    # grpc says only "Failed to bind" (and logs to stderr): try the address first, and say why.
    _check_bindable(*listen, "server.grpc_listen", reuse_port=worker is not None)
    access_log = services.access_log
    observers = Observers(
        services.telemetry, services.repeated_ids, services.metrics.repeated_request_id,
        log_prompts=lambda: access_log.log_prompts, tracing=services.tracing,
    )
    try:
        bound: int = await front.start(
            functools.partial(serve_grpc, max_calls=server.grpc_max_calls, reuse_port=worker is not None, tls=tls.grpc),
            services.router,
            asyncio_host,
            listen,
            shutdown,
            observers,
        )
    except RuntimeError as error:  # grpc's bind failure; anything else is a bug and stays as it is
        if "bind" not in str(error):
            raise
        raise ListenError(_host_port(*listen), "server.grpc_listen", str(error)) from None
    return bound


async def _bound(host: str, port: int, key: str, starting: Awaitable[list[str]]) -> list[str]:
    """A server's bound URLs once it listens; a bind that fails is a :exc:`ListenError` naming ``key``."""
    try:
        return await starting
    except (OSError, BaseExceptionGroup) as error:  # a bind inside a nursery arrives in a group
        failed = lone_os_error(error)
        if failed is None:
            raise
        raise ListenError(_host_port(host, port), key, failed.strerror or str(failed)) from None


def _check_bindable(host: str, port: int, key: str, *, reuse_port: bool) -> None:
    """Raise :exc:`ListenError` if ``host:port`` cannot be bound now (as a server would bind it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(address)
    except OSError as error:
        raise ListenError(_host_port(host, port), key, error.strerror or str(error)) from None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _redacted(url: str) -> str:
    """A Redis URL without its password, for the log."""
    scheme, _, rest = url.partition("://")
    _, at, host = rest.rpartition("@")
    return f"{scheme}://{'***@' if at else ''}{host}"


async def drain_router(router: Router, timeout: float) -> bool:
    """Stop admitting and wait up to ``timeout`` s for in-flight requests; True if all finished."""
    router.drain()
    stats = router.statistics()
    log.info("draining: %d requests in flight or queued; waiting up to %g s", stats.open_requests, timeout)
    with trio.move_on_after(timeout):
        await router.wait_idle()
        log.info("drained: no request in flight")
        return True
    log.warning("drain timeout (%g s) passed with %d requests left; cancelling them", timeout, router.statistics().open_requests)
    return False


async def _drain_then_stop(router: Router, drain: trio.Event, shutdown: trio.Event) -> None:
    await drain.wait()
    with trio.CancelScope() as scope:
        # shutdown set meanwhile (a second signal) cuts the drain short
        async with trio.open_nursery() as nursery:

            async def cut_short() -> None:
                await shutdown.wait()
                scope.cancel()

            nursery.start_soon(cut_short)
            await drain_router(router, router.config.timeouts.drain_timeout)
            nursery.cancel_scope.cancel()
    shutdown.set()


def _tune_gc() -> None:
    """Keep garbage collections off the request path's tail.

    Freezing what start-up made takes it out of every later collection. A
    young generation of 10,000 objects was chosen by ``python -m bench
    hold`` (bench/results/hold): at 700 (Python's default) a relay of 256
    streams spent 37-46 ms a second collecting, and opening 10,000 streams
    could not finish; at 50,000 young passes took 75-150 ms while streams
    piled up (and 22-50 ms in steady relay); at 10,000 they took 33 ms on
    average while 10,000 streams opened and at most 10-35 ms in steady
    relay. /metrics shows every pause (``tailguard_gc_pause_seconds``).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 100)


# glibc's mallopt parameter for the size from which malloc maps memory of its own.
_M_MMAP_THRESHOLD = -3
_BIG_BUFFER = 1 << 20


def _return_big_buffers() -> None:
    """Give memory of big bodies back to the system as soon as they are freed.

    glibc serves a request for 1 MiB or more from a mapping of its own, and
    unmaps it on free -- until the first such free, after which it raises that
    threshold (up to 32 MiB) and serves big buffers from its heap, which it
    rarely shrinks. Measured: after a hundred 8 MiB completions relayed, the
    router's RSS stayed 34 MiB above its start. Fixing the threshold keeps
    the first behaviour. Elsewhere than glibc this does nothing.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    if not mallopt(_M_MMAP_THRESHOLD, _BIG_BUFFER):
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused; big buffers stay on the heap")


async def _drain_on_signals(drain: trio.Event, shutdown: trio.Event) -> None:
    """SIGTERM or SIGINT drains gracefully; a second one stops at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not drain.is_set():
                log.info("received %s: draining (send it again to stop at once)", name)
                drain.set()
            else:
                log.info("received %s again: stopping now", name)
                shutdown.set()
                return
