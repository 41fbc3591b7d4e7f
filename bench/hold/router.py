"""The router under a GC threshold of the benchmark's choosing: a launcher around the ``tailguard`` CLI, and one router's life.

The thresholds are set by this benchmark, not by a server option: the
router runs under :func:`router_child`, whose thread waits for the server's
own ``gc.set_threshold`` at start-up and then sets the threshold asked for;
the child logs the thresholds in force, and the report quotes that line.
"""

from __future__ import annotations

import gc
import resource
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from bench.harness import procs

T = TypeVar("T")

THRESHOLD_WAIT_S = 60.0  # the child's wait for the server's own gc.set_threshold
THRESHOLD_LOG = "bench.hold: gc thresholds"
_CHILD_ENTRY = "import sys; from bench.hold.router import router_child; sys.exit(router_child(sys.argv[1:]))"


def router_child(argv: Sequence[str]) -> int:
    """``tailguard`` CLI in this process, ``argv[0]`` the GC thresholds to impose ("a,b,c", or "server").

    The server sets its thresholds once it listens; a thread here waits for
    that (any change from the interpreter's) and sets ours after it, then
    logs what is in force, for the benchmark to quote. RLIMIT_NOFILE's soft
    limit is raised to the hard one first.
    """
    from tailguard.server.cli import main as tailguard_main

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs.raise_nofile(hard)
    wanted = None if argv[0] == "server" else parse_thresholds(argv[0])
    threading.Thread(target=_impose_threshold, args=(wanted,), name="bench-gc-threshold", daemon=True).start()
    return tailguard_main(list(argv[1:]))


def _impose_threshold(wanted: tuple[int, int, int] | None) -> None:
    initial = gc.get_threshold()
    deadline = time.monotonic() + THRESHOLD_WAIT_S
    while gc.get_threshold() == initial and time.monotonic() < deadline:
        time.sleep(0.01)
    server = gc.get_threshold()
    if wanted is not None:
        gc.set_threshold(*wanted)
    print(f"{THRESHOLD_LOG} {gc.get_threshold()} in force (the server's own: {server}; frozen objects: {gc.get_freeze_count()})", file=sys.stderr, flush=True)


def parse_thresholds(text: str) -> tuple[int, int, int] | None:
    """``--gc-threshold A,B,C`` (empty: the server's own)."""
    if not text:
        return None
    a, b, c = (int(v) for v in text.split(","))
    return a, b, c


async def start_router(nursery: trio.Nursery, config: Path, thresholds: tuple[int, int, int] | None, log: Path) -> trio.Process:
    """tailguard (HTTP only) under :func:`router_child`; cancelling ``nursery`` terminates it."""
    spec = "server" if thresholds is None else ",".join(map(str, thresholds))
    command = [sys.executable, "-c", _CHILD_ENTRY, spec, "serve", "--config", str(config), "--no-grpc", "--log-level", "WARNING"]
    with log.open("ab") as out:  # the child holds its own descriptor
        return await procs.start_process(nursery, command, out)


async def thresholds_in_force(log: Path, process: trio.Process) -> str:
    """The child's line saying which GC thresholds are in force (bounded wait), e.g. "(700, 20, 100) in force (...)"."""
    with trio.move_on_after(5.0):
        while process.returncode is None:
            for line in procs.log_tail(log).splitlines():
                if line.startswith(THRESHOLD_LOG):
                    return line[len(THRESHOLD_LOG) :].strip()
            await trio.sleep(0.05)
    return "unknown (the router did not say)"


def in_force(said: str) -> str:
    """The thresholds alone, from the child's line (:func:`thresholds_in_force`)."""
    return said.split(" in force", 1)[0]


async def with_router(
    config: Path,
    thresholds: tuple[int, int, int] | None,
    log: Path,
    port: int,
    run: Callable[[trio.Process, dict[str, int], str], Awaitable[T]],
    pids: dict[str, int],
) -> T:
    """Start a router, wait until it listens and says its GC thresholds, ``run(tg, pids, said)``, stop it."""
    async with trio.open_nursery() as nursery:
        tg = await start_router(nursery, config, thresholds, log)
        await procs.wait_ready(port, tg, "tailguard")
        said = await thresholds_in_force(log, tg)
        result = await run(tg, {**pids, "tailguard": tg.pid}, said)
        if tg.returncode is not None:
            raise RuntimeError(f"tailguard exited with {tg.returncode} during the run")
        await procs.stop(tg)
        nursery.cancel_scope.cancel()
    log.write_bytes(b"")  # the next router's lines only
    return result
