"""The floor for the gRPC flood: a grpc.aio server that refuses every completion call at once and does nothing else.

``bench chaos`` floods it with the same client, the same calls and the same
count as tailguard, in a process of its own on the same cores, just before
tailguard's round. What a refusal costs it is what the client, grpc and the
machine cost; what tailguard's refusals take beyond it is tailguard's.

Run: ``python -m bench.chaos.grpc_floor --port PORT`` (until killed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc

from tailguard.server.grpc.api import MAX_CONCURRENT_CALLS, server_options
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

FLOOR_CODE = "floor"  # its refusals' x-tailguard-error-code, so a table tells them from tailguard's
_REFUSAL = (("x-tailguard-error-code", FLOOR_CODE), ("retry-after", "1"))


class Refuser(pb_grpc.CompletionsServicer):  # type: ignore[misc]  # generated, untyped
    """Every completion call: RESOURCE_EXHAUSTED, with trailing metadata like tailguard's."""

    async def _refuse(self, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the floor refuses every call", _REFUSAL)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        await self._refuse(context)

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        await self._refuse(context)

    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        await self._refuse(context)
        yield pb.CompletionChunk()  # pragma: no cover  # an async generator, as grpc.aio wants a streaming handler

    async def CompleteStream(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        await self._refuse(context)
        yield pb.CompletionChunk()  # pragma: no cover


async def serve(port: int) -> None:
    """Listen on 127.0.0.1:``port`` with tailguard's transport options (stream and pending bounds), until cancelled."""
    server = grpc.aio.server(options=server_options(MAX_CONCURRENT_CALLS))
    pb_grpc.add_CompletionsServicer_to_server(Refuser(), server)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"the floor could not listen on 127.0.0.1:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.grpc_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
