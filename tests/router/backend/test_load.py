"""The backends' own load: parsing vLLM's /metrics, and scraping it without breaking on anything."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from tailguard.router.backend import METRICS_BODY_LIMIT, BackendLoad, BackendProbe, parse_vllm_metrics, scrape
from tailguard.router.config import EndpointConfig
from tailguard.router.fleet import Endpoint
from tailguard.sim import PROFILES, SimApp
from tailguard.sim.canned import canned_transport, sim_canned_transport
from tests.helpers.engines import MODEL, in_process_engine
from tests.helpers.sockets import QUICK, engines_on_sockets

# What vLLM V1 (0.10) serves with data parallelism 2: two engines, one
# model, and the bulk of the text is histograms, counters and process stats.
VLLM_V1 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18745.0
python_gc_objects_collected_total{generation="1"} 3213.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.318336e+09
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 5120.0
http_requests_total{handler="/metrics",method="GET",status="2xx"} 361.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 41.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 38.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.8125
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.6640625
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.914e+06
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.871e+06
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7331e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.5e+06
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.2e+06
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_preemptions_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2391.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 170.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 301.25
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 118.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1733.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2540.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2561.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2561.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27153"} 1.0
"""

# vLLM before the V1 rename: no engine label, the KV gauge named for the GPU.
VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama-8b"} 5.0
vllm:num_requests_running{model_name="llama-8b-lora-sql"} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="llama-8b"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama-8b"} 1.0
vllm:num_requests_waiting{model_name="llama-8b-lora-sql"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama-8b"} 0.25
vllm:gpu_cache_usage_perc{model_name="llama-8b-lora-sql"} 0.25
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="llama-8b"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="llama-8b"} 4.0
vllm:e2e_request_latency_seconds_count{model_name="llama-8b"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="llama-8b"} 3.5
"""


def test_v1_text_sums_queues_and_takes_the_fullest_cache() -> None:
    load = parse_vllm_metrics(VLLM_V1, scraped_at=12.5)
    assert load == BackendLoad(
        running=79.0,
        waiting=7.0,
        kv_cache_usage=0.8125,
        ok=True,
        scraped_at=12.5,
        prefix_cache_queries=5.785e6,  # both engines' totals; the _created timestamp is no value
        prefix_cache_hits=2.7e6,
        prefix_cache_hit_ratio=None,  # a first scrape has no interval
    )


def counters(queries: float, hits: float, *, prefix: str = "vllm:prefix_cache", suffix: str = "_total") -> str:
    """A V1 page with one engine's prefix-cache counters."""
    return (
        'vllm:num_requests_running{model_name="m"} 1\n'
        f'{prefix}_queries{suffix}{{model_name="m"}} {queries}\n{prefix}_hits{suffix}{{model_name="m"}} {hits}\n'
    )


@pytest.mark.parametrize(
    ("before", "after", "ratio"),
    [
        pytest.param((1000.0, 400.0), (1500.0, 700.0), 0.6, id="hits over queries meanwhile"),
        pytest.param((1000.0, 400.0), (1000.0, 400.0), None, id="nothing looked up: no ratio, not 0 or NaN"),
        pytest.param((1000.0, 400.0), (200.0, 50.0), 0.25, id="engine restarted: its new totals"),
        pytest.param((0.0, 0.0), (3000.0, 3000.0), 1.0, id="all cached"),
    ],
)
def test_hit_ratio_is_over_the_scrape_interval(before: tuple[float, float], after: tuple[float, float], ratio: float | None) -> None:
    previous = parse_vllm_metrics(counters(*before), scraped_at=0.0)
    load = parse_vllm_metrics(counters(*after), scraped_at=5.0, previous=previous)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == after
    assert load.prefix_cache_hit_ratio == (None if ratio is None else pytest.approx(ratio))


def test_hit_ratio_needs_a_baseline_with_counters() -> None:
    failed = BackendLoad.failed(0.0)
    assert parse_vllm_metrics(counters(10.0, 5.0), scraped_at=1.0, previous=failed).prefix_cache_hit_ratio is None
    no_counters = parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 1\n', scraped_at=0.0)
    assert no_counters.ok and no_counters.prefix_cache_queries is None and no_counters.prefix_cache_hit_ratio is None
    assert parse_vllm_metrics(counters(10.0, 5.0), scraped_at=1.0, previous=no_counters).prefix_cache_hit_ratio is None


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [
        pytest.param("vllm:prefix_cache", "", id="counter without _total"),
        pytest.param("vllm:gpu_prefix_cache", "_total", id="V1 before the rename"),
    ],
)
def test_other_spellings_of_the_counters(prefix: str, suffix: str) -> None:
    previous = parse_vllm_metrics(counters(100.0, 10.0, prefix=prefix, suffix=suffix), scraped_at=0.0)
    load = parse_vllm_metrics(counters(200.0, 60.0, prefix=prefix, suffix=suffix), scraped_at=1.0, previous=previous)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (200.0, 60.0) and load.prefix_cache_hit_ratio == pytest.approx(0.5)


def test_the_renamed_counters_win_when_both_are_served() -> None:
    both = counters(100.0, 10.0) + counters(900.0, 900.0, prefix="vllm:gpu_prefix_cache")
    assert parse_vllm_metrics(both, scraped_at=0.0).prefix_cache_queries == 100.0


@pytest.mark.parametrize(("gauge", "ratio"), [("0.375", 0.375), ("-1", None), ("NaN", None)])
def test_v0_reports_its_own_hit_rate_gauge(gauge: str, ratio: float | None) -> None:
    text = VLLM_V0 + f'vllm:gpu_prefix_cache_hit_rate{{model_name="llama-8b"}} {gauge}\n'
    load = parse_vllm_metrics(text, scraped_at=0.0)
    assert load.prefix_cache_queries is None and load.prefix_cache_hit_ratio == ratio


def test_prefix_counters_alone_are_no_load() -> None:
    # A page with only the cache counters carries none of vLLM's load gauges.
    assert not parse_vllm_metrics('vllm:prefix_cache_queries_total{model_name="m"} 5\n', scraped_at=0.0).ok


def test_older_vllm_reports_kv_usage_under_the_gpu_name() -> None:
    load = parse_vllm_metrics(VLLM_V0, scraped_at=0.0)
    assert (load.running, load.waiting, load.kv_cache_usage, load.ok) == (7.0, 1.0, 0.25, True)


def test_the_v1_kv_name_wins_when_both_are_served() -> None:
    # The simulator (and vLLM releases during the rename) serve both names.
    text = VLLM_V1 + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99\n'
    assert parse_vllm_metrics(text, scraped_at=0.0).kv_cache_usage == 0.8125


def test_a_gauge_vllm_does_not_serve_is_none() -> None:
    text = 'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} NaN\n'
    load = parse_vllm_metrics(text, scraped_at=0.0)
    assert (load.running, load.waiting, load.kv_cache_usage, load.ok) == (3.0, None, None, True)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("<html><body><h1>404 Not Found</h1></body></html>\n", id="html"),
        pytest.param('{"detail": "Not Found"}', id="json"),
        pytest.param("\x00\xff garbage {{{ 1 2 3", id="garbage"),
        pytest.param('vllm:num_requests_running{model_name=unquoted} 3\n', id="broken vllm line"),
        pytest.param("vllm:num_requests_running{model_name=\"m\"} three\n", id="broken vllm value"),
        pytest.param(VLLM_V1.replace("vllm:", "sglang:"), id="not vllm"),
    ],
)
def test_text_without_vllm_load_is_not_ok(text: str) -> None:
    assert parse_vllm_metrics(text, scraped_at=3.0) == BackendLoad.failed(3.0)


def test_a_broken_line_elsewhere_does_not_spoil_the_load() -> None:
    text = VLLM_V1.replace("process_resident_memory_bytes 2.318336e+09", "process_resident_memory_bytes {oops")
    assert parse_vllm_metrics(text, scraped_at=0.0).running == 79.0


def endpoint_for(handler: Callable[[httpx.Request], object], url: str = "http://gpu-0:8000") -> Endpoint:
    return Endpoint(EndpointConfig(url, 4), connect_timeout=1.0, transport=canned_transport(handler), closer=lambda client: None)  # type: ignore[arg-type]


def serve_text(text: str) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(200, text=text, headers={"content-type": "text/plain; version=0.0.4"})

    return handler


async def test_metrics_text_refuses_bodies_over_the_limit() -> None:
    at_limit = BackendProbe("http://a", connect_timeout=1.0, transport=canned_transport(serve_text("#" * METRICS_BODY_LIMIT)))
    over = BackendProbe("http://b", connect_timeout=1.0, transport=canned_transport(serve_text("#" * (METRICS_BODY_LIMIT + 1))))
    text = await at_limit.metrics_text()
    assert text is not None and len(text) == METRICS_BODY_LIMIT
    assert await over.metrics_text() is None
    for client in (at_limit, over):
        await client.aclose()


async def test_404_hang_and_success_in_one_scrape_take_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    missing = endpoint_for(lambda request: httpx.Response(404, json={"detail": "Not Found"}), "http://no-metrics:8000")
    hanging = endpoint_for(hang, "http://hanging:8000")
    good = endpoint_for(serve_text(VLLM_V1), "http://vllm:8000")
    started = trio.current_time()
    await scrape([missing, hanging, good], timeout=2.0)
    assert trio.current_time() - started == pytest.approx(2.0)
    assert missing.load == BackendLoad.failed(started)  # answered at once
    assert hanging.load == BackendLoad.failed(started + 2.0)
    assert good.load is not None and good.load.ok and good.load.running == 79.0
    for endpoint in (missing, hanging, good):
        await endpoint.aclose()


async def test_a_refused_connection_is_not_ok() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port now: connecting is refused.
    endpoint = Endpoint(EndpointConfig(f"http://127.0.0.1:{port}", 4), connect_timeout=1.0, transport=None, closer=lambda client: None)
    with trio.fail_after(5):
        await scrape([endpoint], timeout=3.0)
    assert endpoint.load is not None and not endpoint.load.ok and endpoint.load.running is None
    await endpoint.aclose()


async def test_unavailable_load_is_logged_once_and_its_return_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    serving = False

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=VLLM_V1) if serving else httpx.Response(404)

    endpoint = endpoint_for(handler)
    caplog.set_level("INFO", logger="tailguard.backend_load")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tailguard.backend_load"]

    for _ in range(3):
        await scrape([endpoint], timeout=1.0)
    assert messages() == ["endpoint http://gpu-0:8000: /metrics is unavailable (unreachable, not 200, or too large); no engine-side load is shown for it meanwhile"]
    serving = True
    for _ in range(2):
        await scrape([endpoint], timeout=1.0)
    assert len(messages()) == 2 and "again" in messages()[1]
    serving = False
    await scrape([endpoint], timeout=1.0)
    await scrape([endpoint], timeout=1.0)
    assert len(messages()) == 3
    await endpoint.aclose()


@asynccontextmanager
async def streams(client: httpx.AsyncClient, count: int, *, started: int) -> AsyncIterator[None]:
    """``count`` long streaming requests, submitted in order; the first ``started`` have a token out.

    A token out means the engine runs the sequence; the rest wait for a seat.
    Leaving closes every stream, which aborts its sequence. The body iterators
    are kept until then: an abandoned one is finalized by Trio at some later
    checkpoint, and finalizing it closes its connection.
    """
    body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 20_000, "stream": True}
    async with AsyncExitStack() as stack:
        responses = [await stack.enter_async_context(client.stream("POST", "/v1/completions", json=body)) for _ in range(count)]
        bodies = [response.aiter_raw() for response in responses[:started]]
        for response, chunks in zip(responses, bodies):
            assert response.status_code == 200
            await anext(chunks)
        yield


async def test_scrape_follows_the_simulated_engine_queue(autojump_clock: trio.testing.MockClock) -> None:
    params = PROFILES["latency"].replace(max_num_seqs=2)
    async with in_process_engine(params) as (engine, client):
        endpoint = Endpoint(EndpointConfig("http://sim", 4), connect_timeout=1.0, transport=sim_canned_transport(SimApp(engine, model=MODEL)), closer=lambda client: None)
        await scrape([endpoint], timeout=1.0)
        assert endpoint.load is not None
        assert (endpoint.load.running, endpoint.load.waiting, endpoint.load.kv_cache_usage) == (0.0, 0.0, 0.0)
        async with streams(client, 5, started=2):
            await scrape([endpoint], timeout=1.0)
            load = endpoint.load
            stats = engine.statistics()
            assert load.ok and (load.running, load.waiting) == (2.0, 3.0) == (stats.running, stats.waiting)
            assert load.kv_cache_usage is not None and 0.0 < load.kv_cache_usage < 1.0
        await scrape([endpoint], timeout=1.0)
        assert (endpoint.load.running, endpoint.load.waiting, endpoint.load.kv_cache_usage) == (0.0, 0.0, 0.0)
        await endpoint.aclose()


async def test_scrape_reads_a_simulated_engine_over_a_socket() -> None:
    async with engines_on_sockets([QUICK.replace(max_num_seqs=2)]) as backends:
        endpoint = Endpoint(EndpointConfig(backends.urls[0], 4), connect_timeout=1.0, transport=None, closer=lambda client: None)
        async with httpx.AsyncClient(base_url=backends.urls[0]) as client:
            async with streams(client, 3, started=2):
                with trio.fail_after(5):
                    await scrape([endpoint], timeout=3.0)
        assert endpoint.load is not None and endpoint.load.ok
        assert (endpoint.load.running, endpoint.load.waiting) == (2.0, 1.0)
        await endpoint.aclose()


async def test_scrape_reads_the_simulated_cache_hit_ratio_over_a_socket() -> None:
    # 100-token prompt (4 characters a token): 6 of its 16-token blocks are cached for the next one.
    body = {"model": MODEL, "prompt": "y" * 400, "max_tokens": 2}
    async with engines_on_sockets([QUICK.replace(prefix_caching=True)]) as backends:
        endpoint = Endpoint(EndpointConfig(backends.urls[0], 4), connect_timeout=1.0, transport=None, closer=lambda client: None)
        async with httpx.AsyncClient(base_url=backends.urls[0]) as client:
            with trio.fail_after(10):
                await scrape([endpoint], timeout=3.0)
                assert endpoint.load is not None and endpoint.load.ok
                assert (endpoint.load.prefix_cache_queries, endpoint.load.prefix_cache_hit_ratio) == (0.0, None)
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                await scrape([endpoint], timeout=3.0)
                cold = endpoint.load
                for _ in range(3):
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                await scrape([endpoint], timeout=3.0)
                warm = endpoint.load
                await scrape([endpoint], timeout=3.0)
                idle = endpoint.load
        await endpoint.aclose()
    assert cold is not None and (cold.prefix_cache_queries, cold.prefix_cache_hits, cold.prefix_cache_hit_ratio) == (100.0, 0.0, 0.0)
    assert warm is not None and (warm.prefix_cache_queries, warm.prefix_cache_hits) == (400.0, 3 * 96.0)
    assert warm.prefix_cache_hit_ratio == pytest.approx(0.96)
    assert idle is not None and idle.prefix_cache_hit_ratio is None  # no queries since: no ratio, not a stale one
