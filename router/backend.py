"""Calls to one inference server: the only module that knows httpx.

Each endpoint gets httpx clients whose connection pools add up to its
concurrency cap, in shards of at most ``SHARD_CONNECTIONS``: httpcore scans
every pooled connection on each request and each release, so one pool of
1,000 streams costs O(N) per call and O(N^2) to open N streams (measured:
half the router's CPU while opening 10,000 streams). A call takes the shard
with the most free connections. httpx's exceptions are mapped here, at the
boundary, into the router's error tree.

Read timeouts are deliberately absent: the request's end-to-end cancel scope
bounds every call, and cancelling it closes the backend stream, which is
what makes vLLM abort the generation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from http.cookiejar import CookieJar
from typing import Any

import httpx

from .errors import BackendRejected, BackendUnavailable

_ERROR_BODY_LIMIT = 64 * 1024
# vLLM's /metrics is ~100 KB; a URL that serves something else must not make
# the router buffer an arbitrary download every scrape.
METRICS_BODY_LIMIT = 4 * 1024 * 1024
SHARD_CONNECTIONS = 32


class _NoCookies(CookieJar):
    """A jar that keeps nothing: one caller's backend cookie must never reach
    another caller, and parsing Set-Cookie on every response costs CPU."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def add_cookie_header(self, request: Any) -> None:
        return None


class _Shard:
    """One httpx client and the calls it carries now."""

    __slots__ = ("client", "size", "in_flight")

    def __init__(self, client: httpx.AsyncClient, size: int) -> None:
        self.client = client
        self.size = size
        self.in_flight = 0


class BackendResponse:
    """An open response from the backend; read it with ``read`` or ``chunks``."""

    def __init__(self, response: httpx.Response, url: str) -> None:
        self._response = response
        self._url = url

    @property
    def content_type(self) -> str:
        return str(self._response.headers.get("content-type", "application/json"))

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as error:
            raise BackendUnavailable(f"the backend {self._url} broke the response: {_describe(error)}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The raw body as it arrives (SSE bytes are relayed unparsed)."""
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TransportError as error:
            raise BackendUnavailable(f"the backend {self._url} broke the stream: {_describe(error)}") from None


class BackendClient:
    """POSTs completion requests to one endpoint and opens their responses."""

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int,
        connect_timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        timeout = httpx.Timeout(None, connect=connect_timeout, pool=connect_timeout)
        # One TLS context for all shards: httpx builds (and loads CA roots
        # into) a new one per client otherwise, ~1 MB and ~10 ms each.
        tls = httpx.create_ssl_context()
        sizes = [SHARD_CONNECTIONS] * (max_concurrency // SHARD_CONNECTIONS)
        if max_concurrency % SHARD_CONNECTIONS:
            sizes.append(max_concurrency % SHARD_CONNECTIONS)
        self._shards = [
            _Shard(
                httpx.AsyncClient(
                    base_url=url,
                    limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
                    timeout=timeout,
                    transport=transport,
                    verify=tls,
                    cookies=_NoCookies(),
                ),
                size,
            )
            for size in sizes
        ]
        # Health probes and /metrics scrapes get their own two connections: a
        # busy endpoint's pool is full of streams, and a probe must wait
        # neither behind them nor behind a slow scrape.
        self._probe = httpx.AsyncClient(
            base_url=url, limits=httpx.Limits(max_connections=2), timeout=timeout, transport=transport, verify=tls
        )

    @asynccontextmanager
    async def post(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> AsyncIterator[BackendResponse]:
        """Send the request; yield the open response; close it on every exit.

        Raises BackendRejected for 4xx (the caller's fault, passed through)
        and BackendUnavailable for 5xx, refused or broken connections.
        """
        shard = max(self._shards, key=_room)
        client = shard.client
        request = client.build_request(
            "POST", path, content=json.dumps(body).encode(), headers={"content-type": "application/json", **headers}
        )
        shard.in_flight += 1
        try:
            try:
                response = await client.send(request, stream=True)
            except httpx.TransportError as error:
                raise BackendUnavailable(f"the backend {self.url} could not be reached: {_describe(error)}") from None
            try:
                if response.status_code >= 400:
                    await _raise_for_status(response, self.url)
                yield BackendResponse(response, self.url)
            finally:
                await response.aclose()
        finally:
            shard.in_flight -= 1

    async def health(self) -> bool:
        """Whether ``GET /health`` answers 200 (vLLM's readiness probe)."""
        try:
            response = await self._probe.get("/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def metrics_text(self) -> str | None:
        """The body of ``GET /metrics`` (Prometheus text), or None if there is none to read.

        None for any non-200, an unreachable endpoint, a broken body, or one
        over ``METRICS_BODY_LIMIT`` bytes: a backend without /metrics is
        normal, so nothing here raises. Uses the probe connection, so a busy
        endpoint's full pool of streams never delays it; ``health`` shares
        that one connection and waits while a scrape holds it. Unbounded in
        time: the caller's cancel scope sets the timeout.
        """
        body = bytearray()
        try:
            async with self._probe.stream("GET", "/metrics", headers={"accept": "text/plain"}) as response:
                if response.status_code != 200:
                    return None
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > METRICS_BODY_LIMIT:
                        return None
        except httpx.HTTPError:
            return None
        return body.decode("utf-8", "replace")

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.client.aclose()
        await self._probe.aclose()


def _room(shard: _Shard) -> int:
    """Free connections: the endpoint's cap guarantees some shard has one."""
    return shard.size - shard.in_flight


async def _raise_for_status(response: httpx.Response, url: str) -> None:
    try:
        raw = (await response.aread())[:_ERROR_BODY_LIMIT]
    except httpx.TransportError:
        raw = b""
    message, error_type, code, param = _error_fields(raw, response.status_code)
    if response.status_code < 500:
        raise BackendRejected(message, status=response.status_code, error_type=error_type, code=code, param=param)
    raise BackendUnavailable(f"the backend {url} failed with {response.status_code}: {message}")


def _error_fields(raw: bytes, status: int) -> tuple[str, str | None, str | None, str | None]:
    """Message, type, code and param of an OpenAI- or vLLM-shaped error body."""
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace").strip()
        return (text[:500] or f"HTTP {status}"), None, None, None
    error = payload.get("error", payload) if isinstance(payload, dict) else {}
    if isinstance(error, str):
        return error, None, None, None
    if not isinstance(error, dict):
        return f"HTTP {status}", None, None, None
    code = error.get("code")
    param = error.get("param")
    return (
        str(error.get("message") or f"HTTP {status}"),
        str(error["type"]) if error.get("type") else None,
        str(code) if code is not None and not isinstance(code, int) else None,
        str(param) if param is not None else None,
    )


def _describe(error: httpx.TransportError) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
