"""The clients: the openai SDK with its own retries, each attempt it sends timestamped by an event hook on its HTTP client.

The SDK retries inside one ``create`` call (``AsyncAPIClient.request``):
on a 429 or 5xx it sleeps the ``Retry-After`` it was given (at most 120 s;
none or an unreadable one: 0.5 s doubling, less up to 25% jitter) and
sends again, at most ``max_retries`` times, each attempt with the header
``x-stainless-retry-count``. So the attempts are seen where they leave, on
the HTTP client's request and response hooks, and tied to their logical
request by the ``X-Request-Id`` it sends unchanged on every attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
import openai
import trio

from bench.harness.client import HOST
from bench.harness.short_chat import PROMPT_TOKENS, max_tokens_draws
from bench.harness.unique import run_seed
from bench.retry.model import Options
from tailguard.server.advise.replay.mix import unique_body_for
from tailguard.sim.server import DEFAULT_MODEL

REQUEST_ID = "x-request-id"
RETRY_COUNT = "x-stainless-retry-count"  # the SDK's: how many retries this attempt follows


@dataclass
class Attempt:
    """One HTTP attempt: when it left (s from the run's origin), its retry number, its answer's status and Retry-After."""

    sent: float
    retry: int
    status: int = 0  # 0: no answer (the connection failed or the run's bound cut it)
    retry_after: str | None = None


@dataclass
class Logical:
    """One logical request (one ``create`` call): its arrival, its attempts, how it ended (s from the origin)."""

    number: int
    arrived: float
    attempts: list[Attempt] = field(default_factory=list)
    outcome: str = "cut"  # ok | gave_up (the SDK's last attempt refused) | error (anything else) | cut (the run's bound)
    ended: float = float("nan")


class Attempts:
    """The hooks' record: each request id's attempts, timed from ``origin`` (Trio's clock)."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.by_id: dict[str, Logical] = {}

    async def on_request(self, request: httpx2.Request) -> None:
        logical = self.by_id.get(request.headers.get(REQUEST_ID, ""))
        if logical is not None:
            retry = int(request.headers.get(RETRY_COUNT, "0"))
            logical.attempts.append(Attempt(trio.current_time() - self.origin, retry))

    async def on_response(self, response: httpx2.Response) -> None:
        logical = self.by_id.get(response.request.headers.get(REQUEST_ID, ""))
        if logical is not None and logical.attempts:
            last = logical.attempts[-1]
            last.status, last.retry_after = response.status_code, response.headers.get("retry-after")


def sdk_client(port: int, options: Options, attempts: Attempts) -> openai.AsyncOpenAI:
    """The one SDK client of a set-up (one connection pool), retrying ``options.max_retries`` times, hooked to ``attempts``."""
    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [attempts.on_request], "response": [attempts.on_response]})
    return openai.AsyncOpenAI(
        base_url=f"http://{HOST}:{port}/v1",
        api_key="bench-retry",  # no [auth] in the config: every caller is anonymous; the SDK wants a key
        max_retries=options.max_retries,
        timeout=options.attempt_timeout,
        http_client=http,
    )


def max_tokens_of(seed: int) -> Callable[[], int]:
    """Draws of max_tokens, uniform over MAX_TOKENS, seeded apart from the arrivals."""
    return max_tokens_draws(run_seed(seed, "retry", "max_tokens"))


async def send(client: openai.AsyncOpenAI, logical: Logical, label: str, seed: int, max_tokens: int) -> None:
    """Logical request ``logical.number`` through the SDK, retries and all; its outcome and end time set."""
    body = unique_body_for(PROMPT_TOKENS, max_tokens, logical.number, seed=run_seed(seed, "retry", label))
    messages = body["messages"]
    assert isinstance(messages, list) and len(messages) == 1  # the mix's shapes are one user turn
    try:
        await client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": str(messages[0]["content"])}],
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
            extra_headers={REQUEST_ID: f"{label}-{logical.number}"},
        )
        logical.outcome = "ok"
    except (openai.RateLimitError, openai.InternalServerError) as refused:
        logical.outcome = "gave_up" if refused.status_code in (429, 503) else "error"
    except openai.APIError:
        logical.outcome = "error"
