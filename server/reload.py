"""Hot reload: SIGHUP or a changed file -> validate -> swap atomically, or refuse.

Most keys take effect at once. The ones in :data:`RESTART_ONLY` are read
once, when the process starts (sockets, the HTTP server, worker processes,
the shared ledger, the log format, whether the gRPC port speaks TLS): a
reload that changes one applies the rest, keeps the running value, and logs
a warning naming each such key. README's "Configuration" section lists the
same keys (tests/e2e/test_reload.py compares them).

The listeners' TLS files are watched beside the config file: a rotated
certificate (cert-manager writing a Secret's files) reloads as an edit does,
and new connections get it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from tailguard.router.config import Config, ConfigError, load_config
from tailguard.router.fleet import ModelLenError

log = logging.getLogger("tailguard.reload")

Apply = Callable[[Config], Awaitable[None]]
Prepare = Callable[[Config], Config]
Resolve = Callable[[Config], Awaitable[Config]]

# Keys read only when the process starts, and how to read each from a Config.
# ``cluster`` stands for the whole [cluster] table (its ledger is opened once).
RESTART_ONLY: dict[str, Callable[[Config], object]] = {
    "server.http_listen": lambda c: (c.server.http_host, c.server.http_port),
    "server.grpc_listen": lambda c: (c.server.grpc_host, c.server.grpc_port),
    "server.metrics_listen": lambda c: c.server.metrics_listen,
    "server.workers": lambda c: c.server.workers,
    "server.grpc_max_calls": lambda c: c.server.grpc_max_calls,
    "server.max_body_bytes": lambda c: c.server.max_body_bytes,
    "server.max_header_bytes": lambda c: c.server.max_header_bytes,
    "server.header_timeout": lambda c: c.server.header_timeout,
    "server.body_timeout": lambda c: c.server.body_timeout,
    "server.keep_alive_timeout": lambda c: c.server.keep_alive_timeout,
    "server.write_timeout": lambda c: c.server.write_timeout,
    "server.max_connections": lambda c: c.server.max_connections,
    # Whether the gRPC port speaks TLS, and asks for client certificates: fixed when
    # it opens. Its files (and all of server.http_tls) reload.
    "server.grpc_tls": lambda c: None if c.server.grpc_tls is None else c.server.grpc_tls.client_ca_file is not None,
    "logging.format": lambda c: c.logging.format,
    "cluster": lambda c: c.cluster,
}


def restart_needed(old: Config, new: Config) -> list[str]:
    """The restart-only keys whose value differs between ``old`` and ``new``, in RESTART_ONLY's order."""
    return [key for key, read in RESTART_ONLY.items() if read(old) != read(new)]


def without_restart_only(new: Config, running: Config) -> Config:
    """``new`` with every restart-only key at its ``running`` value: what the process really runs."""
    server = dataclasses.replace(
        new.server,
        **{name: getattr(running.server, name) for name in _RESTART_ONLY_SERVER_FIELDS},
    )
    grpc_tls = RESTART_ONLY["server.grpc_tls"]
    if grpc_tls(new) != grpc_tls(running):  # turned on or off: the running port's files stay too
        server = dataclasses.replace(server, grpc_tls=running.server.grpc_tls)
    logging_config = dataclasses.replace(new.logging, format=running.logging.format)
    return dataclasses.replace(new, server=server, logging=logging_config, cluster=running.cluster)


_RESTART_ONLY_SERVER_FIELDS = (
    "http_host", "http_port", "grpc_host", "grpc_port", "metrics_listen", "workers", "grpc_max_calls", "max_body_bytes",
    "max_header_bytes", "header_timeout", "body_timeout", "keep_alive_timeout",
    "write_timeout", "max_connections",
)


def summarize(old: Config, new: Config) -> str:
    """One line saying what a reload changes: pools, endpoints, caps, classes, and other tables."""
    parts: list[str] = []
    old_pools = {p.name: p for p in old.pools}
    new_pools = {p.name: p for p in new.pools}
    added = [name for name in new_pools if name not in old_pools]
    removed = [name for name in old_pools if name not in new_pools]
    if added or removed:
        parts.append("pools " + " ".join([*(f"+{n}" for n in added), *(f"-{n}" for n in removed)]))

    old_at = {e.url: (p.name, e) for p in old.pools for e in p.endpoints}
    new_at = {e.url: (p.name, e) for p in new.pools for e in p.endpoints}
    endpoint_changes = [f"+{url} ({pool})" for url, (pool, _) in new_at.items() if url not in old_at]
    endpoint_changes += [f"-{url} ({old_at[url][0]})" for url in old_at if url not in new_at]
    endpoint_changes += [
        f"{url} moved {old_at[url][0]}->{pool}" for url, (pool, _) in new_at.items() if url in old_at and old_at[url][0] != pool
    ]
    if endpoint_changes:
        parts.append("endpoints " + ", ".join(endpoint_changes))

    caps: list[str] = []
    for name, pool in new_pools.items():
        before = old_pools.get(name)
        if before is None:
            continue
        for key in ("max_concurrency", "max_queue", "max_model_len"):
            if getattr(before, key) != getattr(pool, key):
                caps.append(f"pools.{name}.{key} {getattr(before, key)}->{getattr(pool, key)}")
        if before.class_max_concurrency != pool.class_max_concurrency:
            caps.append(f"pools.{name}.class_max_concurrency")
    for url, (_, endpoint) in new_at.items():
        if url in old_at and old_at[url][1].max_concurrency != endpoint.max_concurrency:
            caps.append(f"{url} max_concurrency {old_at[url][1].max_concurrency}->{endpoint.max_concurrency}")
    if caps:
        parts.append("caps " + ", ".join(caps))

    old_classes = {c.name: c for c in old.classes}
    new_classes = {c.name: c for c in new.classes}
    class_changes = [f"+{n}" for n in new_classes if n not in old_classes]
    class_changes += [f"-{n}" for n in old_classes if n not in new_classes]
    class_changes += [f"~{n}" for n, c in new_classes.items() if n in old_classes and old_classes[n] != c]
    if [c.name for c in old.classes if c.name in new_classes] != [c.name for c in new.classes if c.name in old_classes]:
        class_changes.append("order")
    if class_changes:
        parts.append("classes " + " ".join(class_changes))

    others = [key for name in _OTHER_TABLES for key in _changed_keys(name, getattr(old, name), getattr(new, name))]
    for name, pool in new_pools.items():
        if name in old_pools:
            others += _changed_keys(f"pools.{name}", old_pools[name], pool, skip=_POOL_KEYS_SUMMARIZED)
    if others:
        parts.append("also " + ", ".join(others))
    return "; ".join(parts) if parts else "no setting changed"


_OTHER_TABLES = ("server", "estimate", "limits", "timeouts", "auth", "logging", "metrics", "rebalance", "discovery", "cluster", "tracing")
_POOL_KEYS_SUMMARIZED = frozenset({"name", "endpoints", "max_concurrency", "max_queue", "class_max_concurrency", "max_model_len"})


def _changed_keys(prefix: str, old: object, new: object, *, skip: frozenset[str] = frozenset()) -> list[str]:
    """The dotted keys of one table that differ (no values: [auth] holds secrets' digests)."""
    if old == new:
        return []
    if old is None or new is None or not dataclasses.is_dataclass(old):
        return [prefix]  # a table added or removed ([cluster])
    names = [f.name for f in dataclasses.fields(old) if f.name not in skip]
    return [f"{prefix}.{name}" for name in names if getattr(old, name) != getattr(new, name)]


class ConfigReloader:
    """Watches one config file; applies each valid new version, refuses the rest.

    ``prepare`` turns the file's config into the one the process runs (the
    command line's overrides, a worker's share of the caps): it was applied
    at start, so it is applied to every reloaded file too. ``resolve`` then
    fills in what the file leaves to the engines (pools' ``max_model_len``,
    asked of them on every reload, even of an unchanged file); its
    ``ModelLenError`` refuses the reload.
    """

    def __init__(
        self,
        path: Path,
        current: Config,
        apply: Apply,
        *,
        on_result: Callable[[bool], None] | None = None,
        prepare: Prepare | None = None,
        resolve: Resolve | None = None,
    ) -> None:
        self._path = path
        self._shown = path.absolute()  # not resolved: a ConfigMap's symlinks change on every update
        self._current = current
        self._apply = apply
        self._prepare = prepare or (lambda config: config)
        self._resolve = resolve
        self._on_result = on_result or (lambda ok: None)
        self._lock = trio.Lock()
        self._mtime = self._versions()
        self._interval_changed = trio.Event()
        self.reloads_ok = 0
        self.reloads_failed = 0

    @property
    def current(self) -> Config:
        """The config running now (restart-only keys as the process started)."""
        return self._current

    async def reload(self) -> bool:
        """Load, validate and apply the file now; False (and a log line) if refused.

        All or nothing, and never fatal: a file that fails validation, or any
        failure while applying it (an engine that cannot start, a bug), keeps
        the running config, is logged, and counts as a failed reload. The
        process keeps serving. Restart-only keys that changed are named in a
        warning and keep their running values.
        """
        async with self._lock:
            self._mtime = self._versions()
            try:
                config = self._prepare(await trio.to_thread.run_sync(load_config, self._path))
            except ConfigError as error:
                self._failed()
                log.error("config reload refused, keeping the running config: %s", error)
                return False
            if self._resolve is not None:
                try:
                    config = await self._resolve(config)
                except ModelLenError as error:
                    self._failed()
                    log.error("config reload refused, keeping the running config: %s: %s", self._shown, error)
                    return False
                except Exception:  # a bug: logged, and the process keeps serving the running config
                    self._failed()
                    log.exception("config reload failed while asking the engines; keeping the running config")
                    return False
            if (
                config.digest == self._current.digest
                and _model_lens(config) == _model_lens(self._current)
                and _tls(config) == _tls(self._current)
            ):
                log.info("config reload: %s is unchanged (digest %s); nothing changed", self._shown, config.digest)
                return True
            pending = restart_needed(self._current, config)
            config = without_restart_only(config, self._current)
            summary = summarize(self._current, config)
            try:
                await self._apply(config)
            except ConfigError as error:  # a TLS file that changed again since the check
                self._failed()
                log.error("config reload refused, keeping the running config: %s", error)
                return False
            except Exception:
                self._failed()
                log.exception("config reload failed while applying %s; keeping the running config", self._shown)
                return False
            interval_changed = config.server.reload_poll_interval != self._current.server.reload_poll_interval
            watched = _tls_files(self._current) != _tls_files(config)
            self._current = config
            if watched:  # other TLS files from now on: their versions as they are now
                self._mtime = self._versions()
            self.reloads_ok += 1
            self._on_result(True)
            log.info("config reloaded from %s (digest %s): %s", self._shown, config.digest, summary)
            if pending:
                log.warning(
                    "config reload: %s changed in %s but take%s effect only after a restart; the running value%s kept",
                    ", ".join(pending), self._shown, "s" if len(pending) == 1 else "", " is" if len(pending) == 1 else "s are",
                )
            if interval_changed:
                self._interval_changed.set()
                self._interval_changed = trio.Event()
            return True

    def _failed(self) -> None:
        self.reloads_failed += 1
        self._on_result(False)

    async def watch_signals(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reload on every SIGHUP."""
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                await self.reload()

    async def watch_file(self, interval: float | None = None) -> None:
        """Reload when the file's modification time changes (polled; no inotify dependency).

        Polls every ``server.reload_poll_interval`` s of the running config,
        read again after each reload (0: no polling until a reload sets one);
        a fixed ``interval`` (tests) overrides it.
        """
        while True:
            every = self._current.server.reload_poll_interval if interval is None else interval
            changed = self._interval_changed
            if every > 0:
                with trio.move_on_after(every):
                    await changed.wait()
            else:
                await changed.wait()
            if changed.is_set():
                continue  # a reload set a new interval: wait by it from now on
            if self._versions() != self._mtime:
                await self.reload()

    def _versions(self) -> list[tuple[int, int, int] | None]:
        """The config file's version, then each TLS file's the running config names."""
        return [_version(self._path), *(_version(Path(name)) for name in _tls_files(self._current))]


def _tls(config: Config) -> tuple[object, ...]:
    """The listeners' TLS, fingerprints included: a rotated file is a change though the text is not."""
    return (config.server.http_tls, config.server.grpc_tls)


def _tls_files(config: Config) -> list[str]:
    return [name for tls in (config.server.http_tls, config.server.grpc_tls) if tls is not None for name in tls.files]


def _model_lens(config: Config) -> list[tuple[str, int]]:
    """Each pool's max_model_len: an unchanged file whose engines now report another value is a change."""
    return [(pool.name, pool.max_model_len) for pool in config.pools]


def _version(path: Path) -> tuple[int, int, int] | None:
    """What identifies the file's version: a ConfigMap swaps in a new file (a new inode),
    an editor may keep the time to the second, so all three are compared."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_ino, stat.st_size)
