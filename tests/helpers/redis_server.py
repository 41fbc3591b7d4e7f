"""A real redis-server on 127.0.0.1, on a free port, started and stopped by the test."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import coredis
import pytest

from tests.helpers.process import free_port

REDIS = shutil.which("redis-server")


class RedisServer:
    """One redis-server process without persistence; ``stop`` and ``start`` again on the same port (empty), or ``pause``."""

    def __init__(self) -> None:
        if REDIS is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS is not None and self._process is None
        self._process = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def pause(self) -> None:
        """SIGSTOP: Redis keeps its memory and its connections, and answers nothing until ``resume``."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(10)
            self._process = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def redis_client(url: str) -> AsyncIterator[Any]:
    """A plain client of the test's Redis, to look at (or flush) what the ledger keeps there."""
    client: Any = coredis.Redis.from_url(url, decode_responses=True)
    async with client:
        yield client
