"""The prompt estimate learns each model's real size from the engines' usage (issue 33, item 3).

A canned engine counts every prompt as ``K`` times the router's raw rule (a
token per 4 ASCII characters, 4 a message and 4 for the reply's turn), as a
small byte-level BPE counts hex. Once a few answers (whole or streamed) have
said so, the router sizes the next hex prompt by what it learnt: the context
check refuses what it admitted before, the class follows the corrected size,
the token budget reserves it, and /metrics shows the factor. Only public
seams: the router's ``open``, the request's record, ``Metrics.render``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.admission import RouterRequest
from tailguard.router.backend import ConnectorTransport
from tailguard.router.config import Config, EndpointConfig, parse_config
from tailguard.router.errors import PromptTooLong
from tailguard.router.observe import RequestRecord
from tailguard.server.errors_map import http_error
from tailguard.server.metrics import Metrics
from tailguard.sim.canned import canned_transport
from tests.helpers.engines import MODEL

K = 3  # the engine's count over the raw rule, for every prompt
URL, BATCH_URL = "http://gpu-0:8000", "http://gpu-1:8000"
LEARN_AFTER = 8  # the shipped [estimate] learn_after


def config(*, max_model_len: int = 32768, top: str = "") -> Config:
    """Two pools of one engine each, the shipped classes' thresholds (interactive: prompt <= 500, max_tokens <= 128)."""
    return parse_config(f"""{top}
[pools.interactive]
max_concurrency = 4
max_queue = 16
max_model_len = {max_model_len}
models = ["{MODEL}"]
endpoints = [{{ url = "{URL}", max_concurrency = 4 }}]

[pools.batch]
max_concurrency = 4
max_queue = 16
max_model_len = {max_model_len}
models = ["{MODEL}"]
endpoints = [{{ url = "{BATCH_URL}", max_concurrency = 4 }}]

[classes.interactive]
pool = "interactive"
max_prompt_tokens = 500
max_output_tokens = 128
queue_timeout = 3.0

[classes.batch]
pool = "batch"
queue_timeout = 30.0
""")


def raw_estimate(text: str) -> int:
    """The raw rule for a one-message chat of ASCII ``text`` (README, "What a request goes through", item 1)."""
    return math.ceil(len(text) / 4) + 4 * 2


def hex_text(characters: int, seed: int = 0) -> str:
    """Hex without word breaks, as a key or a hash: the kind of text a small tokenizer spends a token on every ~1.4 characters."""
    digits = "0123456789abcdef"
    return "".join(digits[(i * 7 + seed * 13 + i // 5) % 16] for i in range(characters))


async def engine(request: httpx.Request) -> httpx.Response:
    """An engine whose usage counts ``K`` times the raw rule; a whole answer or a stream, as asked."""
    if not request.url.path.endswith("/completions"):  # a health probe
        return httpx.Response(200, json={"object": "list", "data": []})
    body = json.loads(await request.aread())
    prompt = K * raw_estimate(body["messages"][0]["content"])
    usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
    if not body.get("stream"):
        message = {"role": "assistant", "content": "ok"}
        return httpx.Response(200, json={"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage})
    events = [
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage},
    ]
    sse = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + b"data: [DONE]\n\n"
    return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})


@asynccontextmanager
async def router_over_engine(cfg: Config) -> AsyncIterator[Router]:
    def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
        return canned_transport(engine)

    router = Router(cfg, transport_factory=transport_for, seed=0)
    await router.check_health()
    try:
        yield router
    finally:
        await router.aclose()


def chat(text: str, *, max_tokens: int = 100, stream: bool = False, request_id: str = "r") -> RouterRequest:
    return RouterRequest(kind="chat", request_id=request_id, model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=stream)


async def send(router: Router, request: RouterRequest) -> RequestRecord:
    """The request answered to its end; its record (what admission decided)."""
    record = RequestRecord(request.request_id, "http", trio.current_time())
    with trio.fail_after(30):
        async with router.open(request, record=record) as completion:
            if request.stream:
                async for _ in completion.chunks():
                    pass
            else:
                await completion.read()
    return record


async def teach(router: Router, *, stream: bool = False) -> None:
    """``LEARN_AFTER`` answers to hex prompts of ~200 estimated tokens: enough for the ratio to apply."""
    for n in range(LEARN_AFTER):
        await send(router, chat(hex_text(800, seed=n), stream=stream, request_id=f"teach-{n}"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_admitted_before_learning_is_refused_once_the_engines_usage_says_it_does_not_fit(
    stream: bool, autojump_clock: trio.testing.MockClock
) -> None:
    text = hex_text(8000)  # 2,008 tokens by the rule, 6,024 by the engine's count
    async with router_over_engine(config(max_model_len=8193, top="[limits]\noutput_cap_tokens = 4096\n")) as router:
        before = await send(router, chat(text, max_tokens=3000, stream=stream))
        assert before.prompt_tokens == raw_estimate(text) == 2008  # 2,008 + 3,000 fit 8,193: admitted, for vLLM to refuse
        await teach(router, stream=stream)
        with pytest.raises(PromptTooLong, match=r"exceeds the 8193-token context") as refused:
            await send(router, chat(text, max_tokens=3000, stream=stream))
    answer = http_error(refused.value)  # what the caller is told, from the one error table
    assert answer.status == 400 and answer.body["error"] == {
        "message": refused.value.message, "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded",
    }  # fmt: skip


async def test_the_input_cap_counts_the_corrected_size(autojump_clock: trio.testing.MockClock) -> None:
    text = hex_text(6000)
    async with router_over_engine(config(top="[limits]\ninput_cap_tokens = 4000\n")) as router:
        assert (await send(router, chat(text))).prompt_tokens == 1508
        await teach(router)
        with pytest.raises(PromptTooLong, match="over this service's input cap of 4000"):
            await send(router, chat(text))


async def test_the_class_follows_the_corrected_size(autojump_clock: trio.testing.MockClock) -> None:
    text = hex_text(1400)  # 358 tokens by the rule: interactive (<= 500); ~1,070 by the engine's count
    async with router_over_engine(config()) as router:
        assert (await send(router, chat(text))).request_class == "interactive"
        await teach(router)
        after = await send(router, chat(text, request_id="after"))
    assert after.request_class == "batch" and (after.prompt_tokens or 0) > 3 * 350


async def test_the_token_budget_reserves_the_corrected_size(autojump_clock: trio.testing.MockClock) -> None:
    text = hex_text(2000)
    async with router_over_engine(config(top="[limits]\nanonymous_tokens_per_minute = 1000000\n")) as router:
        await teach(router)
        record = RequestRecord("held", "http", trio.current_time())
        async with router.open(chat(text, max_tokens=64, request_id="held"), record=record) as completion:
            # Reserved at admission, before the engine's usage settles it: the corrected prompt and max_tokens.
            assert record.prompt_tokens is not None and record.prompt_tokens >= K * raw_estimate(text) - 3 * 8
            assert record.budget_tokens == record.prompt_tokens + 64
            await completion.read()
    assert record.budget_tokens == K * raw_estimate(text) + 1  # settled to what it cost: the engine's prompt and completion


async def test_metrics_show_each_models_learnt_ratio_by_kind_of_text(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engine(config()) as router:
        metrics = Metrics(router)
        try:
            assert "tailguard_prompt_estimate_ratio{" not in metrics.render().decode()
            await teach(router)
            text = metrics.render().decode()
        finally:
            metrics.close()
    [ratio] = re.findall(rf'^tailguard_prompt_estimate_ratio{{kind="dense",model="{MODEL}"}} (\S+)$', text, re.M)
    [seen] = re.findall(rf'^tailguard_prompt_estimate_observations_total{{kind="dense",model="{MODEL}"}} (\S+)$', text, re.M)
    # Each answer: K x (200 + 8) tokens; less the template's 8 and the 1.5 of the 6 letters any text may
    # hold as a word (router/admission/estimate.py's _WORD), both at the rule's 1 (never seen), over the hex's 198.5.
    assert float(ratio) == pytest.approx((K * 208 - 8 - 1.5) / 198.5) and float(seen) == LEARN_AFTER
