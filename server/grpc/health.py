"""``grpc.health.v1.Health`` on the asyncio side: Check, and Watch streams that end when the server stops.

grpc_health's own asyncio servicer keeps every Watch stream open until the
server cancels it. A client with client-side health checking (grpc's
``healthCheckConfig``) holds one all the time, so ``server.stop(grace)`` on
an idle tailguard waited its whole grace (5 s) for a watcher that is no work
in flight. Here, once the server stops, each watcher is sent NOT_SERVING and
its stream ends (status OK): the grace is left to completion calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["Health"]

_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # generated, untyped
    """Each service's status, set from the Trio side (through the bridge); asyncio side only."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Event()  # replaced at each change: a watcher waits on the one it read the status under
        self._stopping = False

    async def set(self, service: str, status: int) -> None:
        """``service``'s status from now on (ignored once the server stops: it stays NOT_SERVING)."""
        if not self._stopping and self._status.get(service) != status:
            self._status[service] = status
            self._wake()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; each watcher is told so, and its stream ends."""
        self._stopping = True
        for service in self._status:
            self._status[service] = _NOT_SERVING
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        """Each change of the service's status; the last one, NOT_SERVING, as the server stops."""
        last: int | None = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._stopping:
                return
            await changed.wait()
