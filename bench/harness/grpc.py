"""The gRPC side of the load generators: grpc.aio runs on an asyncio thread beside Trio."""

from __future__ import annotations

from tailguard.server.grpc.bridge import AsyncioHost

_CANCEL_GRACE_S = 30.0  # what the thread's loop gets to finish cancelled calls

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
