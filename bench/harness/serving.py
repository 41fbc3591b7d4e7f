"""A server child held for the length of a block: started, ready on /health, checked at the end, stopped on every way out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from bench.harness.procs import stop, wait_ready


@asynccontextmanager
async def ready_process(start: Callable[[trio.Nursery], Awaitable[trio.Process]], port: int, name: str) -> AsyncIterator[trio.Process]:
    """``start(nursery)``'s process once ``port`` answers /health; a block it died during fails; always stopped after.

    The stop is shielded, so a block cancelled (Ctrl-C, a failing sibling)
    still terminates the child before the nursery's scope is cancelled.
    """
    async with trio.open_nursery() as nursery:
        process = await start(nursery)
        try:
            await wait_ready(port, process, name)
            yield process
            if process.returncode is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} during the run")
        finally:
            with trio.CancelScope(shield=True):
                await stop(process)
            nursery.cancel_scope.cancel()
