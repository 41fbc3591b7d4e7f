"""Observability of the prefix cache and of placement: the counts, the scraped hit ratio, the access line."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import trio
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tailguard.router import Router
from tailguard.router.config import MetricsConfig, TracingConfig
from tailguard.router.fleet import PLACEMENT_KINDS
from tailguard.router.observe import RequestRecord
from tailguard.router.observe.tracing import Tracing
from tailguard.server.metrics import Metrics
from tailguard.server.placement_metrics import PlacementCounts
from tests.helpers.router import two_pool_config, with_digest
from tests.helpers.sockets import QUICK, engines_on_sockets, eventually, tailguard
from tests.server.test_operations import samples, value

# ~150 tokens (4 characters a token; the chat about 160): several full 16-token blocks to cache.
DOCUMENT = "The quarterly report lists revenue, costs and the outlook for each region in turn. " * 7
MESSAGES = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Summarise it."}]


def record(endpoint: str | None, placement: str | None, pool: str = "interactive") -> RequestRecord:
    return dataclasses.replace(RequestRecord("r", "http", arrival=0.0), pool=pool, endpoint=endpoint, placement=placement)


def counted(counts: PlacementCounts) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[n] for n in ("pool", "endpoint", "decision")): s.value for f in counts.collect() for s in f.samples}


def test_placements_are_counted_per_pool_endpoint_and_decision_and_leave_with_their_endpoint() -> None:
    live = {"http://a", "http://b"}
    counts = PlacementCounts(lambda: live)
    for endpoint, placement in [("http://a", "home"), ("http://a", "home"), ("http://b", "spilled"), ("http://b", None), (None, None)]:
        counts.count(record(endpoint, placement))
    counts.count(record("http://b", "borrowed", pool="batch"))  # the request's pool, on a lender's endpoint
    assert counted(counts) == {
        ("interactive", "http://a", "home"): 2,
        ("interactive", "http://b", "spilled"): 1,
        ("batch", "http://b", "borrowed"): 1,
    }  # a request that never got a seat (no placement) is not counted
    live.discard("http://b")  # DNS dropped it, or rebalancing retired it
    assert counted(counts) == {("interactive", "http://a", "home"): 2}
    live.add("http://b")  # back: from 0, a counter reset to Prometheus
    counts.count(record("http://b", "home"))
    assert counted(counts)[("interactive", "http://b", "home")] == 1


async def test_a_reload_that_removes_an_endpoint_removes_its_placement_series() -> None:
    router = Router(two_pool_config(interactive_urls=["http://gpu-0:8000", "http://gpu-1:8000"]))
    metrics = Metrics(router)
    for url in ("http://gpu-0:8000", "http://gpu-1:8000"):
        metrics.observe(dataclasses.replace(record(url, "home"), request_class="interactive", outcome="ok"))

    def placed() -> set[str]:
        page = samples(metrics.render().decode())
        return {dict(labels)["endpoint"] for name, labels in page if name == "tailguard_placements_total"}

    assert placed() == {"http://gpu-0:8000", "http://gpu-1:8000"}
    router.apply(with_digest(two_pool_config(interactive_urls=["http://gpu-1:8000"]), "smaller"))
    assert placed() == {"http://gpu-1:8000"}
    metrics.close()
    await router.aclose()


async def test_the_trace_carries_the_cache_hit_and_the_placement() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(enabled=True), processor=SimpleSpanProcessor(exporter))
    done = dataclasses.replace(record("http://a:8000", "spilled"), kind="chat", stream=True, arrival=trio.current_time())
    trace = tracing.start(done, None, "POST /v1/chat/completions")
    trace.call("http://a:8000", "chat", "m", 8)
    done.saw_chunk(b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":32}}}\n\n')
    done.finished_at, done.outcome, done.status = trio.current_time(), "ok", 200
    trace.finish(done)
    tracing.shutdown()
    spans = {span.name: dict(span.attributes or {}) for span in exporter.get_finished_spans()}
    root, call = spans["POST /v1/chat/completions"], spans["chat m"]
    assert root["gen_ai.usage.cache_read.input_tokens"] == call["gen_ai.usage.cache_read.input_tokens"] == 32
    assert root["gen_ai.usage.input_tokens"] == 40 and root["tailguard.placement"] == "spilled"


async def test_metrics_and_access_log_show_placement_and_the_engines_cache(caplog: pytest.LogCaptureFixture) -> None:
    cached = QUICK.replace(prefix_caching=True)
    async with engines_on_sockets([cached, cached], prompt_tokens_details=True) as backends:
        config = dataclasses.replace(
            two_pool_config(interactive_urls=backends.urls[:1], batch_urls=backends.urls[1:]),
            metrics=MetricsConfig(backend_scrape_interval=0.05),
        )
        async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            with caplog.at_level(logging.INFO, logger="tailguard.access"):
                body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 4}
                usages = []
                for number in range(3):
                    answer = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": f"whole-{number}"})
                    assert answer.status_code == 200
                    usages.append(answer.json()["usage"])
                streamed = {**body, "stream": True}  # tailguard asks for the usage event; the caller did not
                async with client.stream("POST", "/v1/chat/completions", json=streamed, headers={"x-request-id": "stream"}) as response:
                    relayed = b"".join([chunk async for chunk in response.aiter_bytes()])
                    assert b"[DONE]" in relayed
                await eventually(lambda: "stream" in access_lines(caplog))
            lines = access_lines(caplog)
            home = backends.urls[0]  # the interactive pool's one engine: every request's prefix is there
            warm = usages[1]["prompt_tokens_details"]["cached_tokens"]
            # An interval of warm requests only (the first ones may hold the cold one too): all find the same blocks.
            page = await hit_ratio_page(client, body, home, warm / usages[1]["prompt_tokens"])
    assert warm == usages[2]["prompt_tokens_details"]["cached_tokens"] and warm % 16 == 0 and warm >= usages[1]["prompt_tokens"] - 16
    cold = usages[0]["prompt_tokens_details"]["cached_tokens"]  # vLLM 0.32 with the flag says 0 for a miss
    assert cold in (None, 0)
    assert [lines[f"whole-{n}"]["cached_tokens"] for n in range(3)] == [cold, warm, warm]  # as the engine's usage said
    assert lines["stream"]["cached_tokens"] == warm and b"prompt_tokens_details" not in relayed  # seen, not relayed
    decisions = {(line["endpoint"], line["placement"]) for line in lines.values()}
    assert len(decisions) == 1 and decisions <= {(home, kind) for kind in PLACEMENT_KINDS}
    decision = lines["whole-0"]["placement"]  # the pool's policy's: "home" under prefix affinity
    engine = backends.engines[0]
    assert engine is not None
    stats = engine.statistics()
    at_home = {"pool": "interactive", "endpoint": home}
    assert value(page, "tailguard_placements_total", decision=decision, **at_home) >= 4
    assert value(page, "tailguard_backend_prefix_cache_hit_tokens_total", **at_home) <= stats.prefix_cache_hits
    assert value(page, "tailguard_backend_prefix_cache_hit_tokens_total", **at_home) >= 3 * warm
    other = {"pool": "batch", "endpoint": backends.urls[1]}
    assert value(page, "tailguard_backend_prefix_cache_queried_tokens_total", **other) == 0
    assert ("tailguard_backend_prefix_cache_hit_ratio", frozenset(other.items())) not in page  # no queries: absent, not NaN


async def test_a_hot_prefix_spills_past_the_load_bound_and_is_counted_so(caplog: pytest.LogCaptureFixture) -> None:
    # Two engines, one prompt held open three times: its home takes two (ceil(1.25 x 3 / 2) = 2), the third spills.
    async with engines_on_sockets([QUICK, QUICK, QUICK]) as backends:
        config = dataclasses.replace(two_pool_config(interactive_urls=backends.urls[:2], batch_urls=backends.urls[2:]))
        async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            body = {"messages": MESSAGES, "max_tokens": 120, "stream": True}
            with caplog.at_level(logging.INFO, logger="tailguard.access"), trio.fail_after(20):
                async with AsyncExitStack() as stack:
                    readers = []  # held: a dropped reader's finalizer closes its response, and the caller seems to leave
                    for number in range(3):
                        headers = {"x-request-id": f"hot-{number}"}
                        response = await stack.enter_async_context(client.stream("POST", "/v1/chat/completions", json=body, headers=headers))
                        assert response.status_code == 200
                        readers.append(response.aiter_raw())
                        await anext(readers[-1])  # seated and streaming before the next arrives
                await eventually(lambda: len(access_lines(caplog)) == 3)
                page = samples((await client.get("/metrics")).text)
    lines = access_lines(caplog)
    placed = [(lines[f"hot-{n}"]["endpoint"], lines[f"hot-{n}"]["placement"]) for n in range(3)]
    home = placed[0][0]
    assert placed[:2] == [(home, "home"), (home, "home")]
    assert placed[2][1] == "spilled" and placed[2][0] in backends.urls[:2] and placed[2][0] != home
    for endpoint, decision in set(placed):
        assert value(page, "tailguard_placements_total", pool="interactive", endpoint=endpoint, decision=decision) == placed.count((endpoint, decision))


def access_lines(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    return {r.fields["request_id"]: r.fields for r in caplog.records if hasattr(r, "fields")}


async def hit_ratio_page(
    client: httpx.AsyncClient, body: dict[str, Any], home: str, ratio: float
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics once it shows the home engine's hit ratio at ``ratio``: warm requests keep it busy meanwhile (bounded)."""
    key = ("tailguard_backend_prefix_cache_hit_ratio", frozenset({"pool": "interactive", "endpoint": home}.items()))
    page: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    async with trio.open_nursery() as nursery:

        async def keep_warm() -> None:
            for _ in range(500):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200

        nursery.start_soon(keep_warm)
        with trio.fail_after(10):
            while page.get(key) != pytest.approx(ratio):
                await trio.sleep(0.02)
                page = samples((await client.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    return page
