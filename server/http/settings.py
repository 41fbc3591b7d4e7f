"""The HTTP server's settings, its statistics, its TLS context and the ASGI types it speaks."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from tailguard.router.config import ServerConfig

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_CONFIGURED = ServerConfig()  # the defaults, from their one place


@dataclass(frozen=True)
class HttpSettings:
    """The server's guards (``[server]`` in config.toml); seconds and bytes."""

    max_header_bytes: int = _CONFIGURED.max_header_bytes
    header_timeout: float = _CONFIGURED.header_timeout
    body_timeout: float = _CONFIGURED.body_timeout
    keep_alive_timeout: float = _CONFIGURED.keep_alive_timeout
    write_timeout: float = _CONFIGURED.write_timeout
    max_connections: int = _CONFIGURED.max_connections
    grace_timeout: float = 5.0  # requests in flight at shutdown get this long, then are cancelled
    backlog: int = 1024
    reuse_port: bool = False  # several worker processes accept on the same port (SO_REUSEPORT)

    @classmethod
    def from_config(cls, server: ServerConfig, *, grace_timeout: float) -> HttpSettings:
        return cls(
            max_header_bytes=server.max_header_bytes,
            header_timeout=server.header_timeout,
            body_timeout=server.body_timeout,
            keep_alive_timeout=server.keep_alive_timeout,
            write_timeout=server.write_timeout,
            max_connections=server.max_connections,
            grace_timeout=grace_timeout,
        )


@dataclass(frozen=True)
class ServerStatistics:
    """What the server holds now (tests and metrics read it)."""

    connections: int
    refused_connections: int
    draining: bool


class ServerTls:
    """The context a TLS listener hands each new connection; ``context`` is replaced on reload.

    A connection keeps the context it was accepted with; None serves plain
    TCP (the listener was started with TLS and a reload turned it off).
    """

    __slots__ = ("context",)

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self.context = context

