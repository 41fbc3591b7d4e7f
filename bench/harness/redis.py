"""A redis-server for the benchmarks that run tailguard with ``[cluster]``: one port, no persistence, killed, started again or paused."""

from __future__ import annotations

import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO

import trio

from bench.harness.client import HOST
from bench.harness.procs import free_ports, start_process


class RedisProcess:
    """redis-server on one port, without persistence: killed and started again (empty), or paused, by the benchmark."""

    def __init__(self, nursery: trio.Nursery, port: int, log: IO[bytes] | None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe, self.nursery, self.port, self.log = exe, nursery, port, log
        self.process: trio.Process | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    async def start(self) -> None:
        command = [self.exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        self.process = await start_process(self.nursery, command, self.log)
        with trio.fail_after(10):
            while True:
                try:
                    stream = await trio.open_tcp_stream(HOST, self.port)
                except OSError:
                    await trio.sleep(0.02)
                    continue
                await stream.aclose()
                return

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()
        self.process = None

    def pause(self, paused: bool) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        self.paused = paused


@asynccontextmanager
async def redis_process(log: IO[bytes] | None = None) -> AsyncIterator[RedisProcess]:
    """A redis-server started on a free port for one script's run, and killed at its end."""
    async with trio.open_nursery() as nursery:
        redis = RedisProcess(nursery, free_ports(1)[0], log)
        await redis.start()
        try:
            yield redis
        finally:
            if redis.process is not None:
                await redis.kill()
