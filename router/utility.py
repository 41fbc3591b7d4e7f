"""Calls that generate nothing, relayed to an engine: tokenize, detokenize, count tokens, a stored response's lookup.

They cost an engine a tokenizer's pass, not a step, so they take no seat:
they never wait behind generations and never count as one against a pool's
caps. What bounds them is a limit of their own on calls open at once
(``MAX_OPEN``: a flood is refused 429 ``server_busy`` at once, as the gRPC
gate refuses) and the pool's ``first_byte_timeout`` for the answer. The
engine is the least busy usable endpoint of the first pool that serves the
model; its answer, 4xx included, is relayed as it came. A stored Responses
API response is looked up, or cancelled, on the engine that keeps it
(router/fleet/response_homes.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from .config import GENERATION_KINDS
from .errors import BackendTimeout, BackendUnavailable, InvalidRequest, ModelNotFound, NoBackend, ResponseNotFound, ServerBusy
from .fleet import Fleet, ResponseHomes

# Utility calls open at once, per process: far above what tokenizing clients send, far below what would
# keep the event loop from generations.
MAX_OPEN = 64
# Seconds a stored response's lookup or cancellation may take: it runs on the engine's probe connections,
# which its health checks need.
LOOKUP_TIMEOUT = 5.0


@dataclass(frozen=True)
class UtilityAnswer:
    """An engine's answer to a utility call, relayed as it came."""

    status: int
    content_type: str
    body: bytes
    endpoint: str


class UtilityCalls:
    """Relays utility calls within ``MAX_OPEN`` at once."""

    def __init__(self, fleet: Fleet, homes: ResponseHomes) -> None:
        self._fleet = fleet
        self._homes = homes
        self._open = 0

    @property
    def open(self) -> int:
        """Utility calls open now."""
        return self._open

    async def call(self, path: str, payload: Mapping[str, object], headers: Mapping[str, str]) -> UtilityAnswer:
        """Send ``payload`` to ``path`` on an engine serving its ``model`` (any served model where it names none).

        Raises ModelNotFound (no pool serves it), NoBackend (none of their
        endpoints is usable), ServerBusy (``MAX_OPEN`` calls open), or a
        BackendError when the engine fails.
        """
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string", param="model")
        config = self._fleet.config
        if model is None:  # the generating models' engines (an embedding model's tokenizer is not what a bare call means)
            generating = {klass.pool for klass in config.classes if klass.kinds & GENERATION_KINDS}
            pools = [pool for pool in self._fleet.pools.values() if pool.name in generating]
        else:
            pools = [pool for pool in self._fleet.pools.values() if model in pool.config.models]
        if not pools:
            raise ModelNotFound(f"The model {model!r} does not exist; GET /v1/models lists the models served", param="model")
        candidates = [(endpoint, pool) for pool in pools for endpoint in pool.endpoints if endpoint.usable and endpoint.client is not None]
        if not candidates:
            raise NoBackend(f"no engine serving {model or 'any model'} is available", retry_after=self._fleet.config.timeouts.retry_after)
        endpoint, pool = min(candidates, key=lambda pair: pair[0].in_flight)
        client = endpoint.client
        assert client is not None
        with self._one_more():
            with trio.move_on_after(pool.config.first_byte_timeout):
                status, content_type, body = await client.exchange(path, json.dumps(payload).encode(), headers)
                return UtilityAnswer(status, content_type, body, endpoint.url)
            raise BackendTimeout(f"the backend sent no answer within {pool.config.first_byte_timeout:g} s", endpoint=endpoint.url)

    async def at_home(self, response_id: str, method: str, path: str, body: bytes | None) -> UtilityAnswer:
        """``method path`` on the engine that keeps ``response_id``: its answer as it came.

        Raises ResponseNotFound when this process does not know that engine
        (not relayed here, forgotten, or the endpoint is gone), ServerBusy
        past ``MAX_OPEN``, BackendUnavailable when the engine does not answer.
        """
        url = self._homes.home(response_id)
        endpoint = None if url is None else next((e for pool in self._fleet.pools.values() for e in pool.endpoints if e.url == url), None)
        if endpoint is None:
            raise ResponseNotFound(
                f"no engine known here keeps the response {response_id!r}: tailguard routes a stored response's lookup "
                "to the engine that made it, when this process relayed it",
                param="response_id",
            )
        with self._one_more():
            limit = self._fleet.config.server.max_backend_body_bytes
            answer = None
            with trio.move_on_after(LOOKUP_TIMEOUT):  # an engine answers a lookup from memory: never holds the probe's connections
                answer = await endpoint.probe.relay(method, path, body, limit)
        if answer is None:
            raise BackendUnavailable("the engine keeping the response did not answer", endpoint=endpoint.url)
        status, content_type, content = answer
        return UtilityAnswer(status, content_type, content, endpoint.url)

    @contextmanager
    def _one_more(self) -> Iterator[None]:
        """One more call open, within ``MAX_OPEN`` (ServerBusy past it), however it ends."""
        if self._open >= MAX_OPEN:
            raise ServerBusy(f"{MAX_OPEN} tokenizer calls are open; retry shortly", retry_after=1.0)
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
