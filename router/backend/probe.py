"""Health probes, /metrics scrapes and model-length asks of one engine, on connections of their own.

Apart from :mod:`.client` (the requests a caller's call becomes): a probe
asks what the engine is and whether it answers, never carries a request,
and reads at most a capped body, so a probe never waits behind a stream.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any, Final, Literal

import httpx

from ..config import BackendAccess
from .client import AUTH_STATUSES, ERROR_BODY_LIMIT, METRICS_BODY_LIMIT, NO_ACCESS, describe, read_capped, refused, tls_context

REFUSED: Final = "refused"
Answer = int | Literal["refused"] | None  # a status, a refused connection, or no answer

class ModelLenUnknown(Exception):
    """An endpoint did not say its ``max_model_len``; the message says why (for the log)."""


class BackendProbe:
    """Health probes and /metrics scrapes of one endpoint, on two connections of their own.

    A busy endpoint's request connections are full of streams, and a probe
    must wait neither behind them nor behind a slow scrape. It lives as long
    as its endpoint: a reload that resizes the endpoint's request client never
    closes it under a probe in flight.
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
        access: BackendAccess = NO_ACCESS,
    ) -> None:
        self.url = url
        timeout = httpx.Timeout(None, connect=connect_timeout, pool=connect_timeout)
        tls: ssl.SSLContext | bool = tls_context(url, access) or False
        # tailguard's key goes to /v1/* only: vLLM leaves /health and /metrics open.
        self._v1_headers = {"accept-encoding": "identity", **access.authorization}
        self._probe = httpx.AsyncClient(
            base_url=url, limits=httpx.Limits(max_connections=2), timeout=timeout, transport=transport, verify=tls
        )

    async def health(self) -> Answer:
        """What ``GET /health`` (vLLM's readiness probe) answers: 200 when healthy."""
        return await self.answer("GET", "/health")

    async def completes(self, model: str) -> Answer:
        """What a one-token completion answers: the probe that catches an engine whose
        /health is fine but whose scheduler hangs, and one that refuses tailguard's key (401)."""
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        return await self.answer("POST", "/v1/completions", body)

    async def status(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> int | None:
        """The status the endpoint answers, or None when it does not (a refused connection included)."""
        answer = await self.answer(method, path, body)
        return None if answer == REFUSED else answer

    async def answer(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Answer:
        """The status the endpoint answers, ``REFUSED`` when its host refused the connection, or None
        for any other failure; its body is read only up to ``ERROR_BODY_LIMIT`` (a sick engine may
        answer with a huge one, on every probe)."""
        if self._probe.is_closed:  # a reload retired the endpoint under this probe
            return None
        headers = self._v1_headers if path.startswith("/v1") else {"accept-encoding": "identity"}
        try:
            async with self._probe.stream(method, path, json=body, headers=headers) as response:
                await read_capped(response, ERROR_BODY_LIMIT)  # read to keep the connection, never more
                return response.status_code
        except httpx.ConnectError as error:
            return REFUSED if refused(error) else None
        except httpx.HTTPError:
            return None

    async def relay(self, method: str, path: str, body: bytes | None, limit: int) -> tuple[int, str, bytes] | None:
        """A small call answered whole, whatever its status: (status, content type, body); None when the engine
        does not answer, or answers more than ``limit`` bytes. On the probe's connections: a stored response's
        lookup or cancellation must not wait behind the request client's streams."""
        if self._probe.is_closed:
            return None
        headers = {**(self._v1_headers if path.startswith("/v1") else {"accept-encoding": "identity"}), "content-type": "application/json"}
        try:
            async with self._probe.stream(method, path, content=body, headers=headers) as response:
                content = await read_capped(response, limit)
                if content is None:
                    return None
                return response.status_code, response.headers.get("content-type", "application/json"), content
        except httpx.HTTPError:
            return None

    async def max_model_len(self) -> int:
        """The context length the engine serves: the smallest ``max_model_len`` in ``GET /v1/models``.

        vLLM puts its ``--max-model-len`` in every served model's object
        (``{"object": "list", "data": [{"id": ..., "max_model_len": N}]}``;
        LoRA adapters' objects may leave it out). Unbounded in time: the
        caller's cancel scope sets the timeout. Raises
        :exc:`ModelLenUnknown` saying why there is no value (unreachable, a
        status other than 200, a body that is not that list, or one naming none).
        """
        if self._probe.is_closed:
            raise ModelLenUnknown("its probe was closed (the endpoint left the config)")
        try:
            async with self._probe.stream("GET", "/v1/models", headers=self._v1_headers) as response:
                body = await read_capped(response, METRICS_BODY_LIMIT)
                status = response.status_code
        except httpx.HTTPError as error:
            raise ModelLenUnknown(describe(error)) from None
        if status in AUTH_STATUSES:
            raise ModelLenUnknown(f"GET /v1/models answered {status}: the engine refused tailguard's key (the pool's api_key_env)")
        if status != 200:
            raise ModelLenUnknown(f"GET /v1/models answered {status}")
        if body is None:
            raise ModelLenUnknown(f"GET /v1/models answered more than {METRICS_BODY_LIMIT} bytes")
        try:
            payload = json.loads(body)
        except ValueError:
            raise ModelLenUnknown("GET /v1/models answered something other than JSON") from None
        data = payload.get("data") if isinstance(payload, dict) else None
        lengths: list[int] = [
            value
            for entry in (data if isinstance(data, list) else [])
            if isinstance(entry, dict) and isinstance(value := entry.get("max_model_len"), int) and not isinstance(value, bool) and value > 0
        ]
        if not lengths:
            raise ModelLenUnknown("GET /v1/models names no max_model_len (not a vLLM engine?)")
        return min(lengths)

    async def metrics_text(self) -> str | None:
        """The body of ``GET /metrics`` (Prometheus text), or None if there is none to read.

        None for any non-200, an unreachable endpoint, a broken body, or one
        over ``METRICS_BODY_LIMIT`` bytes: a backend without /metrics is
        normal, so nothing here raises. ``health`` shares the probe's two
        connections and may wait while a scrape holds one. Unbounded in
        time: the caller's cancel scope sets the timeout.
        """
        if self._probe.is_closed:
            return None
        try:
            async with self._probe.stream("GET", "/metrics", headers={"accept": "text/plain"}) as response:
                if response.status_code != 200:
                    return None
                body = await read_capped(response, METRICS_BODY_LIMIT)
        except httpx.HTTPError:
            return None
        return None if body is None else body.decode("utf-8", "replace")

    async def aclose(self) -> None:
        await self._probe.aclose()
