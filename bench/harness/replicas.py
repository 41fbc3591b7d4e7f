"""tailguard replicas as the Redis benchmarks run them: an API key's spec, a running replica, its /health, stopping them all."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.harness.client import HOST, ProtocolError
from bench.harness.open_loop import TokenClient
from bench.harness.procs import stop
from bench.harness.toml import TomlTable
from tailguard.router.quotas import hash_key


@dataclass(frozen=True)
class KeySpec:
    """One ``[[auth.keys]]`` entry and its share of the arrivals."""

    name: str
    share: float
    max_concurrency: int

    @property
    def secret(self) -> str:
        return f"tg-bench-{self.name}-0123456789"  # a benchmark's own made-up key

    def table(self, capped: bool = True) -> TomlTable:
        """Its ``auth.keys`` entry: the name, the secret's SHA-256 and (``capped``) its max_concurrency."""
        cap: TomlTable = {"max_concurrency": self.max_concurrency} if capped else {}
        return {"name": self.name, "key_sha256": hash_key(self.secret), **cap}


@dataclass
class Replica:
    name: str
    port: int
    process: trio.Process
    log: Path

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


async def stop_all(replicas: Sequence[Replica]) -> None:
    async with trio.open_nursery() as nursery:
        for r in replicas:
            nursery.start_soon(stop, r.process)


async def health_of(client: TokenClient, port: int) -> tuple[str, str]:
    """(status, cluster mode) from a replica's /health; ("down", "?") when it does not answer."""
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    with trio.move_on_after(1.0):
        try:
            await client.exchange(request)
            body = json.loads(client.last_piece)
            return str(body.get("status")), str(body.get("cluster", {}).get("mode", "-"))
        except (OSError, trio.BrokenResourceError, ProtocolError, ValueError):
            pass
    return "down", "?"
