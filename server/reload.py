"""Hot reload: SIGHUP or a changed file -> validate -> swap atomically, or refuse."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from router.config import ConfigError, load_config
from router.config_types import Config

log = logging.getLogger("tailguard.reload")

Apply = Callable[[Config], Awaitable[None]]


class ConfigReloader:
    """Watches one config file; applies each valid new version, refuses the rest."""

    def __init__(self, path: Path, current: Config, apply: Apply, *, on_result: Callable[[bool], None] | None = None) -> None:
        self._path = path
        self._current = current
        self._apply = apply
        self._on_result = on_result or (lambda ok: None)
        self._lock = trio.Lock()
        self._mtime = _version(path)
        self.reloads_ok = 0
        self.reloads_failed = 0

    async def reload(self) -> bool:
        """Load, validate and apply the file now; False (and a log line) if refused.

        All or nothing, and never fatal: a file that fails validation, or any
        failure while applying it (an engine that cannot start, a bug), keeps
        the running config, is logged, and counts as a failed reload. The
        process keeps serving.
        """
        async with self._lock:
            self._mtime = _version(self._path)
            try:
                config = await trio.to_thread.run_sync(load_config, self._path)
            except ConfigError as error:
                self._failed()
                log.error("config reload refused, keeping the running config: %s", error)
                return False
            if config.digest == self._current.digest:
                return True
            if (config.server.http_host, config.server.http_port) != (self._current.server.http_host, self._current.server.http_port):
                log.warning("server.http_listen changed; it takes effect only after a restart")
            try:
                await self._apply(config)
            except Exception:
                self._failed()
                log.exception("config reload failed while applying %s; keeping the running config", self._path)
                return False
            self._current = config
            self.reloads_ok += 1
            self._on_result(True)
            log.info("config reloaded from %s (digest %s)", self._path, config.digest)
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

    async def watch_file(self, interval: float) -> None:
        """Reload when the file's modification time changes (polled; no inotify dependency)."""
        while True:
            await trio.sleep(interval)
            if _version(self._path) != self._mtime:
                await self.reload()


def _version(path: Path) -> tuple[int, int, int] | None:
    """What identifies the file's version: a ConfigMap swaps in a new file (a new inode),
    an editor may keep the time to the second, so all three are compared."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_ino, stat.st_size)
