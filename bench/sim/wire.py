"""What the simulator's API answers, before any HTTP: a status, headers, and a body whole or in pieces.

``SimApp`` and its routes return a ``SimResponse``; the socket server
(``http.py``) and the in-process transport (``transport.py``) write it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from .api_errors import ApiError

JSON_HEADERS: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
SSE_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
)


class DropConnection(Exception):
    """Close the connection without a response (or in the middle of one's body).

    A sick vLLM does this when its tokenizer panics on a request (the
    ``tokenizer_panic`` fault mode); the fault modes also use it to cut a
    body short. The in-process transport raises httpx's
    ``RemoteProtocolError`` instead, as httpx does over a socket.
    """


class BodyStream(Protocol):
    """A response body produced piece by piece; ``aclose`` when the reader stops early."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass
class SimResponse:
    """A response: either ``body`` or, for streams (and bodies written in pieces), ``stream``."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    stream: BodyStream | None = None

    @classmethod
    def json(cls, status: int, payload: object, extra: list[tuple[str, str]] | None = None) -> SimResponse:
        return cls(status, [*JSON_HEADERS, *(extra or [])], json.dumps(payload).encode())

    @classmethod
    def error(cls, error: ApiError) -> SimResponse:
        return cls(error.status, [*JSON_HEADERS, *error.headers], error.body())

    @classmethod
    def sse(cls, stream: BodyStream) -> SimResponse:
        """A 200 ``text/event-stream`` answer."""
        return cls(200, list(SSE_HEADERS), stream=stream)
