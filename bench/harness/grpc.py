"""The gRPC side of the load generators: grpc.aio runs on an asyncio thread beside Trio; channels, requests and the closed loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from bench.harness.client import CALL_TIMEOUT_S
from bench.harness.clocks import CpuClock
from bench.harness.closed_loop import MESSAGE, Budget, RunResult, Tally
from tailguard.server.grpc.bridge import AsyncioHost
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

_CANCEL_GRACE_S = 30.0  # what the thread's loop gets to finish cancelled calls
_ERROR_BACKOFF_S = 0.05

class AsyncioThread(AsyncioHost):
    """tailguard's own asyncio thread (``server.grpc_bridge``), started outside Trio.

    grpc.aio needs asyncio; everything else here is Trio. One loop serves the
    whole run (grpc.aio binds itself to the loop of its first channel).
    """

    def __init__(self) -> None:
        super().__init__("grpc-client")

    def __enter__(self) -> AsyncioThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=_CANCEL_GRACE_S)
WARMUP_SECONDS = 1.0
WARMUP_CALLS = 300


@dataclass
class GrpcClient:
    """Channels (one HTTP/2 connection each) and their stubs; lives on the asyncio loop."""

    channels: list[grpc.aio.Channel]
    stubs: list[pb_grpc.CompletionsStub]

    @staticmethod
    async def open(address: str, count: int) -> GrpcClient:
        """Open ``count`` channels and wait until tailguard answers on each."""
        # A local subchannel pool: several channels to one address get their own connections.
        channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]
        stubs = [pb_grpc.CompletionsStub(channel) for channel in channels]
        for stub in stubs:
            await stub.GetLimits(pb.GetLimitsRequest(), timeout=CALL_TIMEOUT_S, wait_for_ready=True)
        return GrpcClient(channels, stubs)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def chat_request(max_tokens: int) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[pb.Message(role="user", content=MESSAGE)], options=pb.Options(max_tokens=max_tokens))


async def _unary_worker(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, budget: Budget, tally: Tally) -> None:
    """Call ``Chat`` back to back while the budget lasts."""
    while budget.take():
        start = time.perf_counter()
        try:
            await stub.Chat(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            tally.errors += 1
            await asyncio.sleep(_ERROR_BACKOFF_S)
            continue
        tally.latencies.append(time.perf_counter() - start)


async def grpc_closed_loop(client: GrpcClient, request: pb.ChatRequest, concurrency: int, count: int, seconds: float) -> tuple[Tally, float]:
    """``count`` calls (or ``seconds``) over ``concurrency`` workers spread on the channels; (tally, wall s)."""
    tally = Tally()
    start = time.perf_counter()
    budget = Budget(count, start + seconds)
    workers = [_unary_worker(client.stubs[i % len(client.stubs)], request, budget, tally) for i in range(concurrency)]
    try:
        async with asyncio.timeout(seconds + CALL_TIMEOUT_S):  # a hung call must not hang the run
            await asyncio.gather(*workers)
    except TimeoutError:
        pass
    return tally, time.perf_counter() - start


def run_result(target: str, concurrency: int, tally: Tally, wall: float, before: CpuClock, after: CpuClock) -> RunResult:
    """A RunResult for one gRPC or direct loop; router CPU counted for the gRPC path."""
    return RunResult.from_tally(target, concurrency, tally, wall, before, after, through_router=target == "grpc")
