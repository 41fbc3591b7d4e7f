"""The gRPC flood's client and its readings: calls at once on the asyncio thread, how each ended, a histogram between two scrapes.

Kept apart from the flood (``attacks.grpc_flood``) because it runs on
grpc.aio's asyncio thread (``lab.aio``), not in Trio: plain calls and
records, no ``Phase``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

# Connections the flood's calls share: one, as the client (a connection's streams are what
# one HTTP/2 limit bounds; more connections only spread the same calls).
FLOOD_CHANNELS = 1


def bucket_quantile(before: tuple[dict[float, float], float, float] | None, after: tuple[dict[float, float], float, float] | None, q: float) -> float | None:
    """The ``q`` quantile (a bucket's upper bound) of the histogram's observations between two scrapes."""
    if before is None or after is None:
        return None
    bounds = sorted(after[0])
    deltas = [after[0][b] - before[0].get(b, 0.0) for b in bounds]
    total = deltas[-1] if deltas else 0.0
    if total <= 0:
        return None
    for bound, cumulative in zip(bounds, deltas, strict=True):
        if cumulative >= q * total:
            return bound
    return bounds[-1]


@dataclass(frozen=True)
class Ended:
    """How one flood call ended, as its client saw it."""

    kind: str  # "unary" or "stream"
    code: str  # the status's name, with tailguard's error code after a space when it sent one
    start: float  # asyncio's clock
    elapsed: float
    finished: bool  # an answer with a finish reason
    seen: bool  # it carries tailguard's marks: a handler had it, so it has its access line
    wait: float | None  # served: what the client waited beyond tailguard's total (server-timing), in s


def _server_total(metadata: Any) -> float | None:
    """tailguard's ``total;dur=`` (server-timing, trailing metadata) in seconds, if it sent one."""
    for part in str(dict(metadata or ()).get("server-timing", "")).split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == "total":
            return float(duration) / 1000
    return None


async def flood_calls(address: str, count: int, deadline: float, details: dict[str, str], max_tokens: int) -> list[Ended]:
    """On the asyncio thread: ``count`` calls at once (each ``max_tokens``), 3 streams to 1 unary, on ``FLOOD_CHANNELS`` connections.

    ``details`` gets the first status details seen for each code other than OK.
    """
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(FLOOD_CHANNELS)]
    stubs = [pb_grpc.CompletionsStub(channel) for channel in channels]
    request = pb.ChatRequest(
        messages=[pb.Message(role="user", content="Name a colour, please.")], options=pb.Options(max_tokens=max_tokens)
    )

    async def one(i: int) -> Ended:
        stub = stubs[i % len(stubs)]
        start = time.monotonic()
        finished = False
        kind = "unary" if i % 4 == 3 else "stream"
        trailing: Any = ()
        try:
            if kind == "unary":
                unary = stub.Chat(request, timeout=deadline)
                finished = bool((await unary).finish_reason)
                trailing = await unary.trailing_metadata()
            else:
                stream = stub.ChatStream(request, timeout=deadline)
                async for chunk in stream:
                    finished = finished or bool(chunk.finish_reason)
                trailing = await stream.trailing_metadata()
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
            details.setdefault(code, str(error.details())[:200])
            trailing = error.trailing_metadata() or ()
            word = dict(trailing).get("x-tailguard-error-code")
            if code == "RESOURCE_EXHAUSTED" and isinstance(word, str):
                code = f"{code} {word}"
        elapsed = time.monotonic() - start
        total = _server_total(trailing)
        seen = total is not None or "x-request-id" in dict(trailing) or "x-tailguard-error-code" in dict(trailing)
        wait = elapsed - total if code == "OK" and total is not None else None
        return Ended(kind, code, start, elapsed, finished, seen, wait)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(count))))
    finally:
        for channel in channels:
            await channel.close()
