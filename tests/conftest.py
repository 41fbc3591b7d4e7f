"""Fixtures shared across the suite: simulated engines on sockets, tailguard as a process, a redis-server.

Each one is a set-up that many tests open around their whole body; the
helpers they are built from (``tests/helpers/``) stay importable for tests
that need a variant (other engines, flags, a second server).
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.process import serve_process
from tests.helpers.redis_server import RedisServer, redis_server
from tests.helpers.sockets import QUICK, Backends, engines_on_sockets


@pytest.fixture
async def one_engine() -> AsyncIterator[Backends]:
    """One quick simulated engine on a free loopback port, for the test's whole run."""
    async with engines_on_sockets([QUICK]) as backends:
        yield backends


@pytest.fixture
async def two_engines() -> AsyncIterator[Backends]:
    """Two quick simulated engines on free loopback ports (one a pool in ``two_pool_config``)."""
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        yield backends


@pytest.fixture
async def tailguard_process(tmp_path: Path) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient]]:
    """``tailguard serve --simulate`` as a real process on free ports, healthy, and a client of its HTTP port."""
    async with serve_process(tmp_path) as (process, client):
        yield process, client


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh redis-server on a free port, without persistence (skips the test where none is installed)."""
    with redis_server() as server:
        yield server
