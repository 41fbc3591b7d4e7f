"""Shared set-ups for tests that need simulated engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from tailguard.sim import DEFAULT_MODEL, Engine, EngineParams, SimApp, SimTransport
from tailguard.sim.request import CHARS_PER_TOKEN

MODEL = DEFAULT_MODEL


@asynccontextmanager
async def in_process_engine(
    params: EngineParams,
    *,
    api_key: str | None = None,
    retry_after: int | None = None,
    prompt_tokens_details: bool = False,
    request_id_headers: bool = False,
    per_request_metrics: bool = False,
    max_chars_per_token: int = CHARS_PER_TOKEN,
    **kwargs: object,
) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """An engine behind an httpx client with no sockets (works under MockClock); ``kwargs`` go to the Engine.

    ``prompt_tokens_details``, ``request_id_headers`` and ``per_request_metrics`` are vLLM's
    ``--enable-prompt-tokens-details``, ``--enable-request-id-headers`` and ``--enable-per-request-metrics``.
    """
    engine = Engine(params, **kwargs)  # type: ignore[arg-type]
    app = SimApp(
        engine,
        model=MODEL,
        api_key=api_key,
        retry_after=retry_after,
        enable_prompt_tokens_details=prompt_tokens_details,
        enable_request_id_headers=request_id_headers,
        enable_per_request_metrics=per_request_metrics,
        max_chars_per_token=max_chars_per_token,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with httpx.AsyncClient(transport=SimTransport(app), base_url="http://sim") as client:
            yield engine, client
        nursery.cancel_scope.cancel()
