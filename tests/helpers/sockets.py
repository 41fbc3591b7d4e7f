"""Real-socket set-ups: simulated engines on free ports and tailguard in front."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from tailguard.router.config import Config
from tailguard.server.app import Running, serve
from tailguard.sim import PROFILES, Engine, EngineParams, SimApp
from tailguard.sim.http import Handler, serve as serve_sim
from tests.helpers.engines import MODEL

# Fast enough for real-time tests: ~1 ms a token.
QUICK = PROFILES["latency"].replace(base_ms=1.0, per_seq_ms=0.01, max_model_len=32768)


@dataclass
class Backends:
    urls: list[str]
    engines: list[Engine | None]


@asynccontextmanager
async def engines_on_sockets(specs: list[EngineParams | Handler], *, prompt_tokens_details: bool = False) -> AsyncIterator[Backends]:
    """Engines (or raw handlers) on free loopback ports, in order.

    ``prompt_tokens_details``: the engines run as vLLM with
    ``--enable-prompt-tokens-details`` (their usage says what was cached).
    """
    urls: list[str] = []
    engines: list[Engine | None] = []
    async with trio.open_nursery() as nursery:
        for spec in specs:
            if isinstance(spec, EngineParams):
                engine = Engine(spec)
                await nursery.start(engine.run)
                handler: Handler = SimApp(engine, model=MODEL, enable_prompt_tokens_details=prompt_tokens_details).handle
                engines.append(engine)
            else:
                handler = spec
                engines.append(None)
            port = await nursery.start(serve_sim, handler, "127.0.0.1", 0)
            urls.append(f"http://127.0.0.1:{port}")
        yield Backends(urls, engines)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def tailguard(config: Config, config_path: object = None) -> AsyncIterator[Running]:
    """tailguard's whole process (minus signals' default handling) on a free port."""
    shutdown = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda task_status: serve(config, config_path, http_port=0, shutdown=shutdown, task_status=task_status)  # type: ignore[arg-type]
            )
            try:
                yield running
            finally:
                shutdown.set()


def metric(engine: Engine) -> Mapping[str, int]:
    stats = engine.statistics()
    return {"running": stats.running, "aborted": stats.aborted_total, "finished": stats.finished_total}


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    """Wait (bounded) for a condition that another process or socket makes true."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)
