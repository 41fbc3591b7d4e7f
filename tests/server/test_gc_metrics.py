"""The garbage collector's pauses on /metrics: counted per generation, timed, and unhooked with their owner."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tailguard.router import Router
from tailguard.router.config import ServerConfig
from tailguard.server.metrics import GC_PAUSE_BUCKETS, GcPauses, Metrics
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, tailguard

NAME = "tailguard_gc_pause_seconds"


@dataclass(frozen=True)
class Pauses:
    count: float
    total: float
    buckets: tuple[tuple[str, float], ...]  # (le, cumulative count), as exposed


def pauses(page: str) -> dict[str, Pauses]:
    """The histogram's series by generation, parsed from the exposition text."""
    samples: dict[str, dict[str, object]] = {}
    for family in text_string_to_metric_families(page):
        if family.name != NAME:
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            series = samples.setdefault(sample.labels["generation"], {"buckets": []})
            if sample.name.endswith("_bucket"):
                series["buckets"].append((sample.labels["le"], sample.value))  # type: ignore[attr-defined]
            else:
                series[sample.name.rsplit("_", 1)[1]] = sample.value
    return {
        generation: Pauses(s["count"], s["sum"], tuple(s["buckets"]))  # type: ignore[arg-type]
        for generation, s in samples.items()
    }


def generation_counts(pauses: GcPauses) -> tuple[float, ...]:
    (family,) = pauses.collect()
    return tuple(s.value for s in family.samples if s.name.endswith("_count"))


@contextmanager
def collector_off() -> Iterator[None]:
    """No automatic collection meanwhile: only the test's own gc.collect() calls run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hooked(pauses: GcPauses) -> int:
    return sum(1 for callback in gc.callbacks if getattr(callback, "__self__", None) is pauses)


async def test_forced_collections_show_on_the_real_metrics_page_per_generation() -> None:
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        config = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
        config = dataclasses.replace(config, server=ServerConfig(max_body_bytes=64 * 1024))
        async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            before = pauses((await client.get("/metrics")).text)
            for forced in (0, 1, 2):
                gc.collect(forced)
            response = await client.get("/metrics")
    after = pauses(response.text)
    assert set(before) == set(after) == {"0", "1", "2"}
    expected_bounds = [*(format(b, "g") for b in GC_PAUSE_BUCKETS), "+Inf"]
    for generation in ("0", "1", "2"):
        # Automatic collections may add more; the forced one is always there.
        assert after[generation].count >= before[generation].count + 1, generation
        assert after[generation].total > before[generation].total, generation
        bounds, cumulative = zip(*after[generation].buckets, strict=True)
        assert [float(b) for b in bounds] == [float(b) for b in expected_bounds]
        assert list(cumulative) == sorted(cumulative) and cumulative[-1] == after[generation].count


def test_each_collection_is_timed_once_within_its_wall_time() -> None:
    metrics = Metrics(Router(two_pool_config()))
    with collector_off():
        before = generation_counts(metrics.gc_pauses)
        started = time.perf_counter()
        gc.collect(2)
        wall = time.perf_counter() - started
        after = generation_counts(metrics.gc_pauses)
        page = pauses(metrics.render().decode())
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 0, 1]
    assert 0 < page["2"].total <= wall
    metrics.close()


def test_a_collection_on_another_thread_is_counted() -> None:
    metrics = Metrics(Router(two_pool_config()))
    with collector_off():
        before = generation_counts(metrics.gc_pauses)
        worker = threading.Thread(target=gc.collect, args=(1,))
        worker.start()
        worker.join(timeout=10)
        after = generation_counts(metrics.gc_pauses)
    assert not worker.is_alive()
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 1, 0]
    metrics.close()


def test_close_unhooks_the_collector_and_is_idempotent() -> None:
    metrics = Metrics(Router(two_pool_config()))
    assert hooked(metrics.gc_pauses) == 1
    metrics.close()
    metrics.close()
    assert hooked(metrics.gc_pauses) == 0
    with collector_off():
        before = generation_counts(metrics.gc_pauses)
        gc.collect(0)
        assert generation_counts(metrics.gc_pauses) == before


def test_the_hook_goes_when_its_metrics_are_garbage() -> None:
    metrics = Metrics(Router(two_pool_config()))
    pauses_ = metrics.gc_pauses
    gone = weakref.ref(metrics)
    assert hooked(pauses_) == 1
    del metrics
    gc.collect()  # in case the owner sits in a reference cycle
    assert gone() is None  # the hook did not keep it alive
    assert hooked(pauses_) == 0
