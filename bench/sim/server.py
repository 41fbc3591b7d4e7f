"""Run simulated engines behind sockets: one engine, one port, one API."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import trio

from .app import SimApp
from .engine import Engine
from .faults import Fault, FaultInjector, FaultSwitch
from .http import KEEP_ALIVE_TIMEOUT, serve
from .params import PROFILES, EngineParams
from .pooling import DEFAULT_EMBEDDING_SIZE
from .request import CHARS_PER_TOKEN

DEFAULT_MODEL = "sim-llama-3.1-8b"


@dataclass(frozen=True)
class EngineSpec:
    """Where one engine listens and what it simulates."""

    port: int
    params: EngineParams
    host: str = "127.0.0.1"
    model: str = DEFAULT_MODEL
    time_scale: float = 1.0
    seed: int = 0
    name: str = "engine"
    fault: Fault = Fault()  # the fault mode at start (none)
    api_key: str | None = None  # vLLM's --api-key: /v1/* needs "Authorization: Bearer <key>"
    retry_after: int | None = None  # a Retry-After (seconds) on the 503 of a full queue: the simulator's extra (vLLM sends none)
    enable_prompt_tokens_details: bool = False  # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details
    enable_request_id_headers: bool = False  # vLLM's --enable-request-id-headers: X-Request-Id on responses
    enable_per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics: a "metrics" object on each answer
    max_chars_per_token: int = CHARS_PER_TOKEN  # the tokenizer's longest token: a text over max_model_len x this is refused untokenized
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT  # idle keep-alive connections close after this (uvicorn's 5 s)
    enable_responses_api_store: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: /v1/responses keeps responses
    runner: str = "generate"  # vLLM's --runner: "pooling" serves embeddings, rerank and score instead of generation
    embedding_size: int = DEFAULT_EMBEDDING_SIZE  # a pooling engine's vectors' dimensions (a model's hidden size)


def parse_engines(text: str) -> list[tuple[int, str]]:
    """Parse ``8001:latency,8002:throughput`` into (port, profile) pairs."""
    pairs: list[tuple[int, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        port_text, _, profile = item.partition(":")
        profile = profile or "latency"
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r} in {item!r}; choose from {', '.join(PROFILES)}")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"bad port {port_text!r} in {item!r}") from None
        pairs.append((port, profile))
    if not pairs:
        raise ValueError("no engines given")
    return pairs


async def serve_engine(
    spec: EngineSpec, *, switch: FaultSwitch | None = None, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one engine and its HTTP API until cancelled; reports the bound port.

    ``switch`` holds the engine's fault mode (a new one, set to ``spec.fault``,
    when not given); ``/_sim/faults`` on the engine's port changes it too.
    """
    engine = Engine(spec.params, time_scale=spec.time_scale, seed=spec.seed, name=spec.name)
    app = SimApp(
        engine,
        model=spec.model,
        api_key=spec.api_key,
        retry_after=spec.retry_after,
        enable_prompt_tokens_details=spec.enable_prompt_tokens_details,
        enable_request_id_headers=spec.enable_request_id_headers,
        enable_per_request_metrics=spec.enable_per_request_metrics,
        max_chars_per_token=spec.max_chars_per_token,
        enable_responses_api_store=spec.enable_responses_api_store,
        runner=spec.runner,
        embedding_size=spec.embedding_size,
    )
    if switch is None:
        switch = FaultSwitch(spec.fault, seed=spec.seed)
    handler = FaultInjector(app, switch).handle
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        port = await nursery.start(partial(serve, handler, spec.host, spec.port, gate=switch, keep_alive_timeout=spec.keep_alive_timeout))
        task_status.started(port)
