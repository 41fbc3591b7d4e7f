"""Per-key token and request budgets: reserved at admission, settled at the end, over a sliding minute (router/quotas/budgets.py)."""

from __future__ import annotations

import dataclasses
import re
import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tailguard.router.config import ApiKeyConfig, AuthConfig, ClusterConfig, ConfigError, LimitsConfig, parse_config, render_config
from tailguard.router.errors import BudgetExceeded, InvalidRequest
from tailguard.router.quotas import Budgets, Caller, budgets as budgets_module, budgets_of, duration, hash_key
from tests.helpers.config_text import BASE
from tests.helpers.engines import MODEL
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, Backends, engines_on_sockets, tailguard

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-budgeted-0123456789"


def test_reservations_hold_the_window_and_settling_hands_back_the_rest() -> None:
    budgets = Budgets()

    def reserve(tokens: int, now: float) -> budgets_module.Grant | None:
        return budgets.reserve("k", tokens, tokens_per_minute=1000, requests_per_minute=None, now=now)

    first = reserve(600, 0.0)
    assert first is not None and first.limits.remaining_tokens == 400
    with pytest.raises(BudgetExceeded) as refused:
        reserve(500, 10.0)
    assert refused.value.retry_after == pytest.approx(50.0)  # the 600 leave the window at 60 s
    first.settle(100, served=True)  # it used 100 of its 600
    second = reserve(500, 10.0)
    assert second is not None and second.limits.remaining_tokens == 400
    second.settle(999, served=False)  # it never got a seat: it costs nothing
    assert budgets.limits("k", tokens_per_minute=1000, requests_per_minute=None, now=10.0).remaining_tokens == 900
    second.settle(500, served=True)  # settled once: a second settle changes nothing
    assert budgets.limits("k", tokens_per_minute=1000, requests_per_minute=None, now=10.0).remaining_tokens == 900
    assert budgets.limits("k", tokens_per_minute=1000, requests_per_minute=None, now=60.0).remaining_tokens == 1000
    first.settle(5000, served=True)  # a minute old: out of the window, nothing to change
    assert budgets.limits("k", tokens_per_minute=1000, requests_per_minute=None, now=60.0).remaining_tokens == 1000


def test_no_sixty_seconds_admit_more_than_the_budget() -> None:
    budgets, admitted = Budgets(), []
    for step in range(600):  # a request of 70 tokens every 0.5 s, for 5 minutes, against 1,000 a minute
        now = step * 0.5
        try:
            budgets.reserve("k", 70, tokens_per_minute=1000, requests_per_minute=None, now=now)
            admitted.append(now)
        except BudgetExceeded as refused:
            assert 0 < refused.retry_after <= 60
    for start in admitted:
        assert 70 * sum(1 for at in admitted if start <= at < start + 60) <= 1000
    assert len(admitted) >= 14 * 5  # and the budget is used: 14 of 70 fit a minute


def test_requests_per_minute_and_a_request_over_the_whole_budget() -> None:
    budgets = Budgets()
    for now in (0.0, 1.0):
        assert budgets.reserve("k", 10, tokens_per_minute=None, requests_per_minute=2, now=now) is not None
    with pytest.raises(BudgetExceeded, match="2 requests a minute") as refused:
        budgets.reserve("k", 10, tokens_per_minute=None, requests_per_minute=2, now=2.0)
    assert refused.value.retry_after == pytest.approx(58.0)
    with pytest.raises(InvalidRequest, match="tokens_per_minute") as too_big:
        budgets.reserve("k", 2000, tokens_per_minute=1000, requests_per_minute=None, now=0.0)
    assert too_big.value.param == "max_tokens"
    assert budgets.reserve("other", 10**9, tokens_per_minute=None, requests_per_minute=None, now=0.0) is None


def test_a_refusal_waits_for_both_budgets_to_hold_it() -> None:
    budgets = Budgets()
    for now in range(10):  # ten requests of 100 tokens, one a second: the request budget (10) is used, the tokens (1,000) too
        budgets.reserve("k", 100, tokens_per_minute=1000, requests_per_minute=10, now=float(now))
    with pytest.raises(BudgetExceeded, match="requests a minute and has 0 of its 1000") as refused:
        budgets.reserve("k", 500, tokens_per_minute=1000, requests_per_minute=10, now=10.0)
    assert refused.value.retry_after == pytest.approx(54.0)  # five of the old requests must leave for 500 tokens, not one
    assert budgets.reserve("k", 500, tokens_per_minute=1000, requests_per_minute=10, now=64.0) is not None


def test_headers_are_openais_six() -> None:
    budgets = Budgets()
    grant = budgets.reserve("k", 300, tokens_per_minute=1000, requests_per_minute=10, now=5.0)
    assert grant is not None
    assert dict(grant.limits.headers()) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    assert [duration(s) for s in (0.02, 1.5, 59.25, 360.0)] == ["20ms", "1.5s", "59.25s", "6m0s"]


def test_budgets_are_read_checked_and_rendered() -> None:
    keys = '\n[[auth.keys]]\nname = "metered"\nkey_sha256 = "' + "a" * 64 + '"\n'
    config = parse_config(BASE + keys + "tokens_per_minute = 100000\nrequests_per_minute = 600\n")
    assert (config.auth.keys[0].tokens_per_minute, config.auth.keys[0].requests_per_minute) == (100000, 600)
    assert re.search(r"^  metered .* 100,000\s+600$", render_config(config), re.MULTILINE)
    anonymous = parse_config(BASE + "\n[limits]\nanonymous_tokens_per_minute = 5000\n")
    assert anonymous.limits.anonymous_tokens_per_minute == 5000
    for bad in ("0", "1.5", '"lots"'):
        with pytest.raises(ConfigError) as raised:
            parse_config(BASE + keys + f"tokens_per_minute = {bad}\n")
        assert "auth.keys[0].tokens_per_minute" in str(raised.value)


async def test_the_openai_sdk_reads_the_headers_and_a_refusal_honours_the_computed_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budgets_module, "WINDOW", 2.0)  # a two-second "minute", so the retry comes within the test
    key = ApiKeyConfig("metered", hash_key(KEY), requests_per_minute=2, tokens_per_minute=10_000)
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        base = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
        config = dataclasses.replace(base, auth=AuthConfig(keys=(key,)))
        async with tailguard(config) as running:
            url = running.http_url + "/v1"
            once = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
            answer = await once.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
            assert answer.headers["x-ratelimit-limit-requests"] == "2" and answer.headers["x-ratelimit-remaining-requests"] == "1"
            assert int(answer.headers["x-ratelimit-remaining-tokens"]) < 10_000
            await once.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
            with pytest.raises(openai.RateLimitError) as refused:
                await once.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
            assert refused.value.code == "token_budget_exceeded"
            assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
            assert 1 <= int(refused.value.response.headers["retry-after"]) <= 2
            retrying = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=1)
            start = time.monotonic()
            assert (await retrying.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)).choices
            assert time.monotonic() - start >= 0.5  # it waited as told, once, and then the window held it
            async with httpx.AsyncClient(base_url=running.http_url) as raw:  # a keyless caller is refused before any budget
                assert (await raw.post("/v1/chat/completions", json={"messages": MESSAGES})).status_code == 401
            for client in (once, retrying):
                await client.close()


async def test_the_anonymous_budget_applies_when_auth_is_off(two_engines: Backends) -> None:
    base = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    config = dataclasses.replace(base, limits=dataclasses.replace(LimitsConfig(), anonymous_requests_per_minute=1))
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        body = {"messages": MESSAGES, "max_tokens": 4}
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "0"
        second = await client.post("/v1/chat/completions", json=body)
        assert second.status_code == 429 and second.json()["error"]["code"] == "token_budget_exceeded"
        assert 55 <= int(second.headers["retry-after"]) <= 60
        assert 54_000 < int(second.headers["retry-after-ms"]) <= 60_000  # to the millisecond, for the openai SDK
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        page = (await client.get("/metrics")).text
        assert 'tailguard_caller_budget_remaining{budget="requests",caller="anonymous"} 0.0' in page


async def test_a_request_over_the_whole_budget_is_a_400_that_names_it_with_the_headers(two_engines: Backends) -> None:
    base = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    config = dataclasses.replace(base, limits=dataclasses.replace(LimitsConfig(), anonymous_tokens_per_minute=100))
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        huge = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 500})
        assert huge.status_code == 400 and "tokens_per_minute" in huge.json()["error"]["message"]
        assert huge.headers["x-ratelimit-limit-tokens"] == "100" and huge.headers["x-ratelimit-remaining-tokens"] == "100"


def test_with_cluster_each_replica_keeps_its_static_share_of_a_budget() -> None:
    metered = Caller("metered", frozenset(), None, tokens_per_minute=100_000, requests_per_minute=3)
    config = two_pool_config()
    assert budgets_of(metered, config) == (100_000, 3)
    shared = dataclasses.replace(config, cluster=ClusterConfig("redis://127.0.0.1:6379/0", static_share=0.25))
    assert budgets_of(metered, shared) == (25_000, 1)  # four replicas' shares add up to the budget, never past it
    odd = dataclasses.replace(shared, cluster=ClusterConfig("redis://127.0.0.1:6379/0", static_share=0.29))
    assert budgets_of(Caller("m", frozenset(), None, tokens_per_minute=100), odd) == (29, None)  # not 28.999...
    keyed = '\n[[auth.keys]]\nname = "metered"\nkey_sha256 = "' + "a" * 64 + '"\ntokens_per_minute = 1000\n'
    with pytest.raises(ConfigError, match="cluster.static_share: must be above 0 while callers have budgets"):
        parse_config(BASE + keyed + '\n[cluster]\nredis_url = "redis://127.0.0.1:6379/0"\nstatic_share = 0\n')
