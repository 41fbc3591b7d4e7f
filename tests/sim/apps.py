"""An in-process simulated engine with any of ``SimApp``'s options (the routes' tests: runner, store, flags)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from tailguard.sim import PROFILES, Engine, EngineParams, SimApp, SimTransport
from tests.helpers.engines import MODEL

FAST = PROFILES["latency"].replace(max_model_len=4096, kv_cache_tokens=100_000)


@asynccontextmanager
async def running_app(params: EngineParams = FAST, **options: Any) -> AsyncIterator[tuple[Engine, SimTransport]]:
    """An engine running and its ``SimApp`` (``options``: the app's keyword arguments) as an httpx transport, no sockets."""
    engine = Engine(params)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine, SimTransport(SimApp(engine, model=MODEL, **options))
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def app_client(params: EngineParams = FAST, **options: Any) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """``running_app`` behind an httpx client."""
    async with running_app(params, **options) as (engine, transport):
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            yield engine, client


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body's ``event:`` names and ``data:`` objects, in order (each data line must follow its name)."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            assert name is not None, f"data without an event name: {line}"
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
        else:
            assert line == "", line
    return events
