"""The gRPC client's asyncio side (grpc.aio on ``harness.grpc.AsyncioThread``): streams read to their end and restarted, and streams held open.

The tallies are plain counters the Trio side reads while the asyncio thread
writes them; a cancelled Trio caller cancels the asyncio task, and a
cancelled task cancels its RPCs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import grpc

from bench.harness.client import CALL_TIMEOUT_S
from bench.harness.grpc import GrpcClient
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

STREAMS_PER_WORKER = 10_000  # a count bound on every stream loop besides its deadline
MAX_OPENING = 256  # calls started but not yet routed; paces the ramp so connects do not time out
RAMP_TIMEOUT_S = 75.0
_ERROR_BACKOFF_S = 0.05


@dataclass
class StreamTally:
    """What the stream workers received so far (cumulative; read from the Trio thread)."""

    chunks: int = 0
    streams_done: int = 0
    errors: int = 0


async def _stream_worker(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, deadline: float, tally: StreamTally) -> None:
    """Read one stream to its end, then start the next, until ``deadline`` (perf_counter)."""
    for _ in range(STREAMS_PER_WORKER):
        if time.perf_counter() >= deadline:
            return
        try:
            async for _chunk in stub.ChatStream(request, timeout=CALL_TIMEOUT_S):
                tally.chunks += 1
        except grpc.aio.AioRpcError:
            tally.errors += 1
            await asyncio.sleep(_ERROR_BACKOFF_S)
            continue
        tally.streams_done += 1


async def grpc_streams(client: GrpcClient, request: pb.ChatRequest, streams: int, seconds: float, tally: StreamTally) -> None:
    """``streams`` workers, spread over the client's channels, each restarting its stream until ``seconds`` are up."""
    deadline = time.perf_counter() + seconds
    workers = [_stream_worker(client.stubs[i % len(client.stubs)], request, deadline, tally) for i in range(streams)]
    try:
        async with asyncio.timeout(seconds + CALL_TIMEOUT_S):
            await asyncio.gather(*workers)
    except TimeoutError:
        pass


@dataclass
class OpenTally:
    """Streams of the open-streams phase, by state (read from the Trio thread)."""

    started: int = 0
    pending: int = 0  # started, neither routed (initial metadata) nor failed yet
    routed: int = 0
    first_chunk: int = 0  # ever received their first chunk
    open: int = 0  # received their first chunk and still open
    chunks: int = 0
    ended: int = 0  # finished on their own while they should have been held
    failed: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)


async def _hold(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, timeout: float, tally: OpenTally) -> None:
    """One stream, read until it is cancelled; cancelling cancels the RPC."""
    call = stub.ChatStream(request, timeout=timeout)
    tally.started += 1
    tally.pending += 1
    pending, opened = True, False
    try:
        metadata = await call.initial_metadata()
        if any(key == "x-tailguard-pool" for key, _ in metadata or ()):
            tally.routed += 1
            tally.pending -= 1
            pending = False
        async for _chunk in call:
            tally.chunks += 1
            if not opened:
                opened = True
                tally.first_chunk += 1
                tally.open += 1
        tally.ended += 1
    except grpc.aio.AioRpcError as error:
        tally.failed += 1
        tally.codes[error.code().name] += 1
    finally:
        if pending:
            tally.pending -= 1
        if opened:
            tally.open -= 1
        call.cancel()


async def hold_streams(client: GrpcClient, request: pb.ChatRequest, count: int, timeout: float, tally: OpenTally) -> None:
    """Open ``count`` streams, at most MAX_OPENING unrouted at once, and hold them until cancelled."""
    loop = asyncio.get_running_loop()
    ramp_deadline = loop.time() + RAMP_TIMEOUT_S
    holders: list[asyncio.Task[None]] = []
    try:
        for i in range(count):
            while tally.pending >= MAX_OPENING and loop.time() < ramp_deadline:
                await asyncio.sleep(0.005)
            if loop.time() >= ramp_deadline:
                break
            holders.append(loop.create_task(_hold(client.stubs[i % len(client.stubs)], request, timeout, tally)))
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the new calls go out
        await asyncio.gather(*holders)
    finally:
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
