"""Operations over real sockets: /metrics, the access log, timing headers, request ids, API keys."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config, MetricsConfig, ServerConfig
from tailguard.router.quotas import hash_key
from tailguard.sim import Engine, SimApp, SimResponse
from tests.docs.test_docs import DASHBOARD_METRICS
from tests.helpers.engines import MODEL
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, eventually, tailguard

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
WEB_KEY, ETL_KEY = "sk-web-0123456789", "sk-etl-9876543210"


def config_for(urls: list[str], *, auth: bool = False, **kwargs: object) -> Config:
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], **kwargs)  # type: ignore[arg-type]
    keys = AuthConfig(
        keys=(
            ApiKeyConfig("webapp", hash_key(WEB_KEY)),
            ApiKeyConfig("etl", hash_key(ETL_KEY), frozenset({"batch"}), max_concurrency=1),
        )
    )
    return dataclasses.replace(
        config,
        server=ServerConfig(max_body_bytes=64 * 1024),
        auth=keys if auth else AuthConfig(),
        metrics=MetricsConfig(backend_scrape_interval=0.05, duplicate_request_id_window=10.0),
    )


class Recording:
    """A simulated engine that remembers the headers of each completion request."""

    def __init__(self, engine: Engine) -> None:
        self.app = SimApp(engine, model=MODEL)
        self.request_ids: list[str] = []

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path.endswith("completions"):
            self.request_ids.append(headers.get("x-tailguard-request-id", ""))  # the caller's (x-request-id is the router's own)
        return await self.app.handle(method, path, headers, body)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a /metrics page, keyed by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(page: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return page.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_page_has_every_dashboard_name_and_counts_outcomes() -> None:
    engine = Engine(QUICK)
    recording = Recording(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engines_on_sockets([recording.handle, QUICK]) as backends, tailguard(config_for(backends.urls)) as running:
            async with httpx.AsyncClient(base_url=running.http_url) as client:
                ok = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8}, headers={"x-request-id": "dup-1"})
                assert ok.status_code == 200
                again = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8}, headers={"x-request-id": "dup-1"})
                assert again.status_code == 200 and recording.request_ids == ["dup-1", "dup-1"]
                clamped = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5000})
                assert clamped.headers["x-tailguard-max-tokens"] == "1024"
                too_long = await client.post("/v1/completions", json={"prompt": "word " * 9_000, "max_tokens": 8})
                assert too_long.status_code == 400
                # Wait for a backend scrape, then read the page.
                await eventually(lambda: all(e.load is not None for e in running.router.endpoints))
                page_text = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    page = samples(page_text)
    names = {name for name, _ in page}
    missing = {m for m in DASHBOARD_METRICS if not any(n == m or n.startswith(m + "_") for n in names)}
    assert not missing, f"the dashboard uses metrics /metrics does not export: {sorted(missing)}"
    interactive = {"class": "interactive", "pool": "interactive"}
    assert value(page, "tailguard_requests_total", outcome="ok", **interactive) == 2
    assert value(page, "tailguard_request_e2e_seconds_count", outcome="ok", **interactive) == 2
    assert value(page, "tailguard_request_completion_tokens_sum", outcome="ok", **interactive) == 16
    assert value(page, "tailguard_max_tokens_clamped_total", **{"class": "batch", "pool": "batch"}) == 1
    assert value(page, "tailguard_rejections_total", reason="input_cap", **{"class": "none", "pool": "none"}) == 1
    assert value(page, "tailguard_duplicate_request_ids_total") == 1
    endpoint = {"pool": "interactive", "endpoint": backends.urls[0]}
    assert value(page, "tailguard_backend_scrape_ok", **endpoint) == 1
    assert value(page, "tailguard_backend_requests_running", **endpoint) == 0
    assert value(page, "tailguard_endpoint_max_concurrency", **endpoint) == 8
    assert value(page, "tailguard_config_info", digest="test") == 1


async def test_access_log_and_timing_headers(caplog: pytest.LogCaptureFixture) -> None:
    async with engines_on_sockets([QUICK.replace(base_ms=5.0), QUICK]) as backends, tailguard(config_for(backends.urls, auth=True)) as running:
        auth = {"authorization": f"Bearer {WEB_KEY}"}
        with caplog.at_level(logging.INFO, logger="tailguard.access"):
            async with httpx.AsyncClient(base_url=running.http_url, headers=auth) as client:
                plain = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8}, headers={"x-request-id": "ok-1"})
                timing = dict(part.split(";dur=") for part in plain.headers["server-timing"].split(", "))
                assert set(timing) == {"queue", "total"} and 0 <= float(timing["queue"]) <= float(timing["total"])

                body = {"messages": MESSAGES, "max_tokens": 8, "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "stream-1"}) as streamed:
                    timing = dict(part.split(";dur=") for part in streamed.headers["server-timing"].split(", "))
                    assert set(timing) == {"queue", "ttft"} and float(timing["ttft"]) >= float(timing["queue"])
                    assert streamed.headers["x-accel-buffering"] == "no"
                    assert b"[DONE]" in b"".join([chunk async for chunk in streamed.aiter_bytes()])

                rejected = await client.post("/v1/completions", json={"prompt": "word " * 9_000}, headers={"x-request-id": "big-1"})
                assert rejected.status_code == 400

                # The caller goes away mid-stream: cancelled, and the seat comes back.
                body = {"messages": MESSAGES, "max_tokens": 200, "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "gone-1"}) as leaving:
                    async for _ in leaving.aiter_bytes():
                        break
            await eventually(lambda: any(getattr(r, "fields", {}).get("request_id") == "gone-1" for r in caplog.records))
        await eventually(lambda: running.router.statistics().in_flight == 0)
    lines = {r.fields["request_id"]: r.fields for r in caplog.records if hasattr(r, "fields")}
    ok = lines["ok-1"]
    assert (ok["outcome"], ok["status"], ok["caller"], ok["class"], ok["pool"]) == ("ok", 200, "webapp", "interactive", "interactive")
    assert ok["endpoint"] == backends.urls[0] and ok["max_tokens"] == 8 and ok["completion_tokens"] == 8
    assert ok["prompt_tokens_est"] > 0 and ok["e2e_ms"] >= ok["queue_ms"] >= 0
    streamed_line = lines["stream-1"]  # no usage in the stream: tokens counted from its events
    assert streamed_line["completion_tokens"] == 8 and streamed_line["ttft_ms"] <= streamed_line["e2e_ms"]
    big = lines["big-1"]
    assert (big["outcome"], big["reason"], big["status"]) == ("rejected", "input_cap", 400)
    gone = lines["gone-1"]
    assert (gone["outcome"], gone["reason"], gone["status"]) == ("cancelled", "client_cancelled", 499)
    assert gone["ttft_ms"] is not None and gone["completion_tokens"] < 200
    text = caplog.text + json.dumps(list(lines.values()))
    assert WEB_KEY not in text and "capital of France" not in text and "word word" not in text


async def test_api_keys_401_403_class_override_and_per_key_cap() -> None:
    slow = QUICK.replace(base_ms=10.0)
    async with engines_on_sockets([QUICK, slow]) as backends, tailguard(config_for(backends.urls, auth=True)) as running:
        url = running.http_url + "/v1"
        anonymous = openai.AsyncOpenAI(base_url=url, api_key="sk-unknown", max_retries=0)
        web = openai.AsyncOpenAI(base_url=url, api_key=WEB_KEY, max_retries=0)
        etl = openai.AsyncOpenAI(base_url=url, api_key=ETL_KEY, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as unknown:
            await anonymous.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert unknown.value.code == "invalid_api_key" and "sk-unknown" not in str(unknown.value)
        async with httpx.AsyncClient(base_url=running.http_url) as raw:
            missing = await raw.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
            assert (await raw.get("/v1/models")).status_code == 401
            assert (await raw.get("/health")).status_code == 200 and (await raw.get("/metrics")).status_code == 200
            assert (await raw.get("/v1/limits", headers={"authorization": f"Bearer {WEB_KEY}"})).json()["auth_required"] is True

        models = await web.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.PermissionDeniedError, match="'webapp' may not force the class 'batch'"):
            await web.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_headers={"x-tailguard-class": "batch"})
        forced = await etl.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_headers={"x-tailguard-class": "batch"}
        )
        assert forced.headers["x-tailguard-class"] == "batch" and forced.headers["x-tailguard-pool"] == "batch"

        # etl may have one request in flight; its second is 429 while web's still pass.
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def hold_a_seat() -> None:
                stream = await etl.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, stream=True)
                async for _ in stream:
                    started.set()

            nursery.start_soon(hold_a_seat)
            await started.wait()
            with pytest.raises(openai.RateLimitError) as capped:
                await etl.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
            assert capped.value.code == "caller_concurrency_limit" and capped.value.response.headers["retry-after"] == "1"
            assert (await web.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)).choices
        assert (await etl.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)).choices
        for client in (anonymous, web, etl):
            await client.close()
        async with httpx.AsyncClient(base_url=running.http_url) as raw:
            page = samples((await raw.get("/metrics")).text)
    # Each key's share, by its name: tokens served, its waits, its refusals.
    assert value(page, "tailguard_caller_tokens_total", caller="webapp", kind="completion") == 8  # its one answer
    assert value(page, "tailguard_caller_tokens_total", caller="etl", kind="prompt") > 0
    assert value(page, "tailguard_caller_rejections_total", caller="etl", reason="caller_limit") == 1
    assert value(page, "tailguard_caller_queue_seconds_count", caller="etl") >= 3


async def test_a_backend_without_metrics_breaks_nothing() -> None:
    engine = Engine(QUICK)
    app = SimApp(engine, model=MODEL)

    async def no_metrics(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path == "/metrics":
            return SimResponse(404, [("content-type", "text/plain")], b"not found")
        return await app.handle(method, path, headers, body)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engines_on_sockets([no_metrics, QUICK]) as backends, tailguard(config_for(backends.urls)) as running:
            await eventually(lambda: all(e.load is not None for e in running.router.endpoints))
            async with httpx.AsyncClient(base_url=running.http_url) as client:
                assert (await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})).status_code == 200
                page = samples((await client.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    assert value(page, "tailguard_backend_scrape_ok", pool="interactive", endpoint=backends.urls[0]) == 0
    assert value(page, "tailguard_backend_scrape_ok", pool="batch", endpoint=backends.urls[1]) == 1
    assert value(page, "tailguard_endpoint_healthy", pool="interactive", endpoint=backends.urls[0]) == 1


async def test_bad_request_id_is_refused() -> None:
    async with engines_on_sockets([QUICK, QUICK]) as backends, tailguard(config_for(backends.urls)) as running:
        async with httpx.AsyncClient(base_url=running.http_url) as client:
            response = await client.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"x-request-id": "x" * 200})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-request-id"
    assert response.headers["x-request-id"] != "x" * 200
