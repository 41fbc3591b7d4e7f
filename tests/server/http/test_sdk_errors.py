"""Every row of the README's error table, through the real ``openai`` SDK.

The README promises that the SDK "raises the right exception" and names, per
row, the exception class and whether the SDK retries the request on its own.
Each row here is made to happen for real (a backend that fails on demand, a
pool with no seats, a key over its cap, ...) behind a real tailguard on real
sockets, the official SDK calls it with ``max_retries=1``, and the test checks
the class it raised and how many attempts reached the router (its own
``tailguard_rejections`` counter, by reason). Rows run at once, on threads,
so the SDK's ``Retry-After`` waits (1 s) overlap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tailguard.router.config import (
    ApiKeyConfig,
    AuthConfig,
    ClassConfig,
    Config,
    EndpointConfig,
    EstimateConfig,
    LimitsConfig,
    PoolConfig,
    ServerConfig,
    TimeoutsConfig,
)
from tailguard.router.observe import RequestRecord
from tailguard.sim import SimResponse
from tailguard.sim.app import JSON_HEADERS
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import Faulty, FrontEnds, front_ends

README = Path(__file__).resolve().parents[3] / "README.md"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
KEYS = {"admin": "sk-admin", "plain": "sk-plain", "capped": "sk-capped"}
MAX_BODY_BYTES = 32 * 1024
INPUT_CAP = 1000  # tokens: 4,000 ASCII characters, well under the body cap
OUTPUT_CAP = 64  # over it is refused (over_cap = "reject")
E2E = 1.5  # seconds: a hung non-streaming answer ends here with 504
BUSY_ANSWER = 0.1  # seconds the "busy" engine takes to say its queue is full


class Backend(Faulty):
    """A Faulty backend that can also refuse a completion with vLLM's 400."""

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if self.mode == "reject" and path.endswith("completions"):
            error = b'{"object": "error", "message": "temperature must be <= 2", "type": "BadRequestError", "param": null, "code": 400}'
            return SimResponse(400, list(JSON_HEADERS), error)
        if self.mode == "unauthorized" and path.endswith("completions"):  # a key vLLM does not take (its model list stays open here)
            return SimResponse(401, list(JSON_HEADERS), b'{"error": "Unauthorized"}')
        if self.mode == "busy" and path.endswith("completions"):  # vLLM's own queue is full
            # Answered after the class's queue deadline: a request refused sooner would wait in tailguard's queue.
            await trio.sleep(BUSY_ANSWER)
            error = b'{"error": {"message": "The server is busy", "type": "ServiceUnavailableError", "param": null, "code": 503}}'
            return SimResponse(503, [*JSON_HEADERS, ("retry-after", "1")], error)
        return await super().handle(method, path, headers, body)


# One pool (and class of the same name) per way of failing; None: nothing listens.
POOLS: dict[str, str | None] = {
    "ok": "ok",
    "full": "ok",  # no seats and no queue: 429 queue_full at once
    "wait": "ok",  # no seats: 503 queue_timeout after the class's queue deadline
    "down": None,  # its endpoint fails the health check: 503 no_backend
    "5xx": "5xx",
    "garbage": "garbage",
    "hang": "hang",
    "error_event": "error_event",
    "reject": "reject",
    "unauthorized": "unauthorized",
    "busy": "busy",
}


def make_config(urls: list[str]) -> Config:
    pools = []
    for (name, _), url in zip(POOLS.items(), urls, strict=True):
        seats = 0 if name in ("full", "wait") else 4
        queue = 0 if name == "full" else 4
        pools.append(
            PoolConfig(name, (EndpointConfig(url, max(seats, 1)),), seats, queue, 32768, (MODEL,), first_byte_timeout=0.3)
        )
    queue_timeouts = {"wait": 0.2, "busy": BUSY_ANSWER / 2}
    classes = tuple(ClassConfig(name, name, queue_timeouts.get(name, 1.0), 0) for name in POOLS)
    keys = (
        ApiKeyConfig("admin", hashlib.sha256(KEYS["admin"].encode()).hexdigest(), frozenset(POOLS)),
        ApiKeyConfig("plain", hashlib.sha256(KEYS["plain"].encode()).hexdigest()),
        ApiKeyConfig("capped", hashlib.sha256(KEYS["capped"].encode()).hexdigest(), max_concurrency=0),
    )
    return Config(
        server=ServerConfig(max_body_bytes=MAX_BODY_BYTES),
        estimate=EstimateConfig(),
        limits=LimitsConfig(input_cap_tokens=INPUT_CAP, output_cap_tokens=OUTPUT_CAP, over_cap="reject"),
        timeouts=TimeoutsConfig(end_to_end_timeout=E2E),
        pools=tuple(pools),
        classes=classes,
        digest="sdk-errors",
        auth=AuthConfig(keys),
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the README's table: what the SDK is said to do for it."""

    status: str
    type_code: str
    sdk: str  # the SDK column as written

    @property
    def key(self) -> str:
        """The row's `code` (or its `type` when it has none)."""
        quoted: list[str] = re.findall(r"`([^`]+)`", self.type_code)
        return quoted[-1] if quoted else self.type_code

    @property
    def exception(self) -> str:
        named: list[str] = re.findall(r"`(\w+Error)`", self.sdk)
        return named[0]

    @property
    def retried(self) -> bool:
        return "retried" in self.sdk and "not retried" not in self.sdk


def readme_rows() -> list[Row]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Errors, and what a caller should do") :]
    section = section[: section.index("\n#")]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    sdk_column = header.index("openai SDK")
    rows = []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(Row(cells[0], cells[1], cells[sdk_column]))
    return rows


@dataclasses.dataclass
class Outcome:
    exception: BaseException | None
    attempts: int  # requests the router finished for the row's reason
    seconds: float


# The README row's code (or type) -> (the router's reason, the call that makes it happen).
Call = Callable[[openai.OpenAI], object]


def _chat(pool: str = "ok", *, key: str = "admin", stream: bool = False, request_id: str | None = None, **kwargs: object) -> Call:
    """A chat completion in the class (and pool) ``pool``, with the API key named ``key``."""

    def call(client: openai.OpenAI) -> object:
        options: dict[str, object] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **kwargs}
        client = client.with_options(api_key=KEYS.get(key, key))
        headers = {"x-tailguard-class": pool} if pool != "ok" else {}
        if request_id is not None:
            headers["x-request-id"] = request_id
        if stream:
            return list(client.chat.completions.create(**options, stream=True, extra_headers=headers))  # type: ignore[call-overload]
        return client.chat.completions.create(**options, extra_headers=headers)  # type: ignore[call-overload]

    return call


LONG = [{"role": "user", "content": "word " * INPUT_CAP}]  # ~1,250 tokens: over the input cap, under the body cap
HUGE = [{"role": "user", "content": "x" * MAX_BODY_BYTES}]

CASES: dict[str, tuple[str, Call]] = {
    "invalid_request_error": ("invalid_request", _chat(messages=[])),
    "context_length_exceeded": ("input_cap", _chat(messages=LONG)),
    "max_tokens_too_large": ("max_tokens_cap", _chat(max_tokens=OUTPUT_CAP + 1)),
    "invalid_api_key": ("unauthenticated", _chat(key="sk-nobody")),
    "forbidden": ("forbidden", _chat("reject", key="plain")),
    "model_not_found": ("model_not_found", _chat(model="no-such-model")),
    "body_too_large": ("body_too_large", _chat(messages=HUGE)),
    "queue_full": ("queue_full", _chat("full")),
    "caller_concurrency_limit": ("caller_limit", _chat(key="capped")),
    "queue_timeout": ("queue_timeout", _chat("wait")),
    "no_backend": ("no_backend", _chat("down")),
    "deadline_exceeded": ("e2e_timeout", _chat("hang")),
    "internal_error": ("internal_error", _chat(request_id="broken-sdk")),
    "vLLM's": ("backend_rejected", _chat("reject")),
    "upstream_error": ("backend_unavailable", _chat("5xx")),
    "upstream_auth": ("upstream_auth", _chat("unauthorized")),
    "backend_busy": ("backend_busy", _chat("busy")),
    "backend_timeout": ("backend_timeout", _chat("hang", stream=True)),
    "bad_backend_reply": ("bad_backend_reply", _chat("garbage")),
    "backend_stream_error": ("backend_stream_error", _chat("error_event", stream=True)),
}
GRPC_ONLY = {"server_busy"}  # the HTTP front end has no cap on calls of its own
# Its Retry-After is exact: the SDK's one retry, after it, is admitted. tests/router/quotas/test_budgets.py drives it through the SDK.
# response_not_found: a stored response's lookup, driven through the SDK by tests/server/http/test_sdk_routes.py.
ELSEWHERE = {"token_budget_exceeded", "response_not_found"}
LAST = {"draining": "draining"}  # needs the router to stop admitting: run after the others


def rejections(service: FrontEnds) -> dict[str, float]:
    """The router's own count of requests that ended in each reason."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(service.metrics.render().decode()):
        if family.name == "tailguard_rejections":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels["reason"]
                    counts[reason] = counts.get(reason, 0.0) + sample.value
    return counts


def settled_rejections(service: FrontEnds) -> dict[str, float]:
    """The counts once the router has finished every request: a caller has its answer a moment
    before the router's session records it, so read until no request is open and two reads agree."""
    deadline = time.monotonic() + 5
    last: dict[str, float] | None = None
    while time.monotonic() < deadline:
        open_requests = trio.from_thread.run_sync(lambda: service.router.statistics().open_requests, trio_token=service.token)
        counts = rejections(service)
        if open_requests == 0 and counts == last:
            return counts
        last = counts
        time.sleep(0.05)
    return rejections(service)


def attempt(client: openai.OpenAI, call: Call) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        call(client)
    except openai.OpenAIError as error:
        return error, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Outcome]]:
    """Every row driven once through the SDK (``max_retries=1``)."""
    backends: list[Faulty | None] = [None if mode is None else Backend(mode) for mode in POOLS.values()]
    with pytest.MonkeyPatch.context() as patch, front_ends(backends, make_config) as service:
        original = RequestRecord.saw_answer

        def broken(record: RequestRecord, completion_tokens: int | None) -> None:
            if record.request_id.startswith("broken-"):
                raise RuntimeError("a bug planted by the test")
            original(record, completion_tokens)

        patch.setattr(RequestRecord, "saw_answer", broken)
        # The "down" pool's endpoint refuses connections: its pool's unhealthy_threshold (3) rounds of health checks mark it.
        for _ in range(3):
            trio.from_thread.run(service.router.check_health, trio_token=service.token)
        client = openai.OpenAI(base_url=service.http_url + "/v1", api_key=KEYS["admin"], max_retries=1, timeout=10)
        results: dict[str, Outcome] = {}
        with ThreadPoolExecutor(len(CASES)) as pool:
            futures = {key: pool.submit(attempt, client, call) for key, (_, call) in CASES.items()}
            done = {key: future.result() for key, future in futures.items()}
        counts = settled_rejections(service)
        for key, (reason, _) in CASES.items():
            results[key] = Outcome(done[key][0], int(counts.get(reason, 0)), done[key][1])
        trio.from_thread.run_sync(service.router.drain, trio_token=service.token)
        error, seconds = attempt(client, _chat())
        results["draining"] = Outcome(error, int(rejections(service).get("draining", 0)), seconds)
        client.close()
        yield results


ROWS = readme_rows()


def test_the_readme_table_names_what_the_sdk_does_for_every_row() -> None:
    keys = [row.key for row in ROWS]
    assert sorted(keys) == sorted([*CASES, *GRPC_ONLY, *LAST, *ELSEWHERE])
    for row in ROWS:
        if row.key in GRPC_ONLY:
            assert row.sdk == "gRPC only"
        else:
            assert hasattr(openai, row.exception), row


@pytest.mark.parametrize("row", [r for r in ROWS if r.key not in GRPC_ONLY | ELSEWHERE], ids=lambda r: r.key)
def test_the_sdk_raises_what_the_readme_says(row: Row, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[row.key]
    error = outcome.exception
    assert error is not None, f"{row.key}: the call succeeded"
    assert type(error).__name__ == row.exception, f"{row.key}: {type(error).__name__}: {error}"
    if isinstance(error, openai.APIStatusError) and row.status.isdigit():
        assert error.status_code == int(row.status)
        body = error.body
        assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    # Retried: the SDK sent it again (max_retries=1), after the Retry-After hint (1 s).
    assert outcome.attempts == (2 if row.retried else 1), f"{row.key}: {outcome.attempts} attempts"
    if row.retried and "Retry-After" in row.sdk:
        assert outcome.seconds >= 1.0
