"""Tokens served per tenant, read off each stream's usage event, and the request bytes each tenant sends."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial

from bench.harness.client import CHAT_PATH
from bench.harness.open_loop import TokenClient, TokenPool
from bench.harness.short_chat import PROMPT_TOKENS
from bench.harness.unique import UniqueRequests, run_seed
from bench.tenants.model import KEYS
from tailguard.server.advise.replay.mix import unique_body_for


@dataclass(frozen=True)
class Served:
    """One finished stream's usage, and when it arrived (perf_counter)."""

    at: float
    prompt: int
    completion: int


def usage_of(piece: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of the usage event in ``piece`` (SSE bytes), if it holds one."""
    for line in piece.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage")
            except ValueError:
                continue
            if isinstance(usage, dict):
                return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return None


class UsageClient(TokenClient):
    """A TokenClient that appends each stream's usage (``stream_options.include_usage``) to its pool's list."""

    def __init__(self, port: int, into: list[Served]) -> None:
        super().__init__(port)
        self._into = into

    def piece(self, piece: bytes) -> None:
        if (found := usage_of(piece)) is not None:
            self._into.append(Served(time.perf_counter(), *found))


class UsagePool(TokenPool):
    """One tenant's connections; ``served`` is every usage its streams reported."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.served: list[Served] = []

    def _new(self) -> UsageClient:
        return UsageClient(self.port, self.served)


def body(max_tokens: int, number: int, *, seed: int) -> dict[str, object]:
    """Request ``number``'s streamed chat body: the tenants' prompt, unique, ``max_tokens``, asking for its usage."""
    return {**unique_body_for(PROMPT_TOKENS, max_tokens, number, seed=seed), "stream_options": {"include_usage": True}}


class TenantRequests:
    """``request(n, max_tokens)``: a tenant's request ``n`` to ``port`` with its API key; each length encoded once (nonces seeded by the set-up and tenant)."""

    def __init__(self, port: int, tenant: str, *parts: object) -> None:
        self._port = port
        self._seed = run_seed(*parts, tenant)
        self._lengths: dict[int, UniqueRequests] = {}
        self._auth = f"\r\nAuthorization: Bearer {KEYS[tenant]}\r\n".encode()

    def request(self, number: int, max_tokens: int) -> bytes:
        unique = self._lengths.get(max_tokens)
        if unique is None:
            body_of = partial(body, max_tokens, seed=self._seed)
            unique = self._lengths[max_tokens] = UniqueRequests(self._port, CHAT_PATH, body_of, seed=self._seed)
        return unique.request(number).replace(b"\r\n", self._auth, 1)
