"""Lending bounded by its stall: at most ``lend.prefills`` borrowed requests in prefill per endpoint (virtual time)."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import trio

from tailguard.router import Router
from tailguard.router.config import Config, ConfigError, LendConfig, parse_config, render_config
from tailguard.sim.canned import canned_transport
from tests.helpers.config_text import BASE
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest
from tests.router.fleet.test_lending import BATCH_URLS, LONG_OUTPUT, lending_config, refusing_once, with_batch_promised

LONG_PROMPT = "word " * 2000  # ~2,500 tokens: four times the old 512-token rule


def lend_back(prefills: int | None) -> Config:
    """Interactive has one seat; batch's two endpoints lend back to interactive, ``prefills`` borrowed prefills at once each."""
    base = two_pool_config(interactive_cap=1, batch_cap=4, batch_urls=BATCH_URLS, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    lend = LendConfig(to=("interactive",), prefills=prefills)
    return with_digest(base, "lend-prefills", pools=(interactive, dataclasses.replace(batch, lend=lend)))


async def own_request_ran(router: Router, pool: str) -> None:
    """One request of ``pool``'s own class ran to its end: the pool had own traffic lately, so its prefill bound applies."""
    if pool == "interactive":
        await run_to_end(router, chat("quick?", max_tokens=8, request_id="warm"))
    else:
        await run_to_end(router, chat("a job", max_tokens=LONG_OUTPUT, request_id="warm"))


async def test_a_long_borrowed_prompt_is_lent_and_the_next_waits_for_its_first_token(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), prefills=1))
    async with router_over_engines(config) as fleet:
        await own_request_ran(fleet.router, "interactive")
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        first_token: list[float] = []
        seated: dict[str, tuple[str, float]] = {}

        async def streamed(request_id: str, text: str) -> None:
            with trio.CancelScope(deadline=trio.current_time() + 60):
                async with fleet.router.open(chat(text, max_tokens=LONG_OUTPUT, stream=True, request_id=request_id)) as completion:
                    async for _ in completion.chunks():
                        if request_id == "long" and not first_token:
                            first_token.append(trio.current_time())
                    routing = completion.routing
                    seated[request_id] = (routing.endpoint, routing.queue_seconds)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(streamed, "own", "short job")  # batch's one seat
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(streamed, "long", LONG_PROMPT)  # borrowed, prompt length no bar
            await trio.testing.wait_all_tasks_blocked()
            assert (lender.borrowed, lender.borrowed_prefilling) == (1, 1)
            asked = trio.current_time()
            nursery.start_soon(streamed, "next", "another job")  # three seats idle, but one borrowed prefill is there
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("batch").queue.waiting == 1 and lender.borrowed == 1
        assert seated["long"][0] == INTERACTIVE_URL and seated["next"][0] == INTERACTIVE_URL
        assert seated["next"][1] > 0.02  # waited out the long prefill...
        assert asked + seated["next"][1] == pytest.approx(first_token[0], abs=1e-3)  # ...and no longer
        assert (lender.borrowed, lender.borrowed_prefilling, lender.in_flight) == (0, 0, 0)


async def test_a_borrowed_request_goes_to_another_endpoint_while_one_is_prefilling(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(with_batch_promised(lend_back(prefills=1))) as fleet:
        await own_request_ran(fleet.router, "batch")
        endpoints = [fleet.router.endpoint(url) for url in BATCH_URLS]
        async with trio.open_nursery() as nursery:
            for i in range(3):  # interactive's own seat, then two borrowed: packing would put both on one engine
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert sorted((e.borrowed, e.borrowed_prefilling) for e in endpoints) == [(1, 1), (1, 1)]
        assert [(e.borrowed, e.borrowed_prefilling) for e in endpoints] == [(0, 0), (0, 0)]


async def test_without_the_key_borrowed_prefills_are_unbounded_as_before(autojump_clock: trio.testing.MockClock) -> None:
    # A lender that packs what it lends (its class promised a first token) puts both on one engine, both prefilling.
    async with router_over_engines(with_batch_promised(lend_back(prefills=None))) as fleet:
        endpoints = [fleet.router.endpoint(url) for url in BATCH_URLS]
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert sorted((e.borrowed, e.borrowed_prefilling) for e in endpoints) == [(0, 0), (2, 2)]  # packed, both prefilling
        assert [e.borrowed_prefilling for e in endpoints] == [0, 0]


async def test_a_cancelled_borrowed_request_leaves_no_prefill_counted(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), prefills=1))
    async with router_over_engines(config) as fleet:
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("short job", max_tokens=LONG_OUTPUT, request_id="own"))
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.001):  # the caller leaves during the borrowed prefill
                await run_to_end(fleet.router, chat(LONG_PROMPT, max_tokens=LONG_OUTPUT, request_id="gone"))
            assert (lender.borrowed, lender.borrowed_prefilling, lender.in_flight) == (0, 0, 0)
            _, routing = await run_to_end(fleet.router, chat("next job", max_tokens=LONG_OUTPUT, request_id="next"))
            assert routing.endpoint == INTERACTIVE_URL and routing.queue_seconds == 0


async def test_a_failed_borrowed_request_leaves_no_prefill_counted(autojump_clock: trio.testing.MockClock) -> None:
    def failing(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        """The lender's engine answers every completion with a 500: no other endpoint to retry on."""
        if url != INTERACTIVE_URL:
            return inner

        async def fail(request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                return httpx.Response(500, json={"error": "boom"})
            return await inner.handle_async_request(request)

        return canned_transport(fail)

    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), prefills=1))
    async with router_over_engines(config, wrap=failing) as fleet:
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("short job", max_tokens=LONG_OUTPUT, request_id="own"))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Exception):  # noqa: B017 -- whichever error the router raises, the count must not leak
                await run_to_end(fleet.router, chat(LONG_PROMPT, max_tokens=LONG_OUTPUT, request_id="failed"))
            assert fleet.router.endpoint(BATCH_URL).in_flight == 1
            assert (lender.borrowed, lender.borrowed_prefilling, lender.in_flight) == (0, 0, 0)


async def test_a_retry_carries_the_borrowed_prefill_to_the_new_endpoint(autojump_clock: trio.testing.MockClock) -> None:
    refused: list[str] = []
    async with router_over_engines(lend_back(prefills=1), wrap=refusing_once(refused)) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(2):  # interactive's own seat, then one borrowed, refused on its first endpoint
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            first, second = (fleet.router.endpoint(url) for url in sorted(BATCH_URLS, key=lambda u: u != refused[0]))
            assert (first.borrowed_prefilling, second.borrowed_prefilling) == (0, 1)
        assert (first.borrowed_prefilling, second.borrowed_prefilling, first.in_flight, second.in_flight) == (0, 0, 0, 0)


def test_prefills_is_read_checked_and_rendered() -> None:
    config = parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nprefills = 1\n')
    assert config.pool("interactive").lend == LendConfig(to=("batch",), prefills=1)
    assert "1 borrowed prefill at once an endpoint" in render_config(config)
    assert parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\n').pool("interactive").lend.prefills is None
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nprefills = 0\n')
    assert "prefills" in str(raised.value)


async def test_a_whole_answer_borrowed_under_the_bound_is_asked_as_a_stream_and_frees_the_bound_at_its_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Without a stream its first byte would be its end: one non-streamed borrowed job would hold the bound throughout.
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), prefills=1))
    async with router_over_engines(config) as fleet:
        await own_request_ran(fleet.router, "interactive")
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        bodies: dict[str, bytes] = {}

        async def whole(request_id: str) -> None:
            bodies[request_id], _ = await run_to_end(fleet.router, chat(f"job {request_id}", max_tokens=LONG_OUTPUT, request_id=request_id))

        async with trio.open_nursery() as nursery:
            for request_id in ("own", "lent-1", "lent-2"):
                nursery.start_soon(whole, request_id)
                await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(1.0):  # the second is lent once the first has its first token, long before either ends
                while lender.borrowed < 2:
                    await trio.sleep(0.01)
            assert lender.borrowed_prefilling <= 1 and not bodies
        for request_id in ("lent-1", "lent-2"):
            answer = json.loads(bodies[request_id])
            assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == LONG_OUTPUT


async def test_a_lender_without_own_requests_lately_is_not_held_to_the_bound(autojump_clock: trio.testing.MockClock) -> None:
    # Nobody of its own to keep from queueing behind borrowed prompts: both long jobs are lent and prefill at once.
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), prefills=1))
    async with router_over_engines(config) as fleet:
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        async with trio.open_nursery() as nursery:
            for i in range(3):  # batch's own seat, then two borrowed
                nursery.start_soon(run_to_end, fleet.router, chat(f"{LONG_PROMPT} {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert (lender.borrowed, lender.borrowed_prefilling) == (2, 2)
            await own_request_ran(fleet.router, "interactive")  # its own request comes: the bound holds again
            for i in (3, 4):  # one more is lent and prefills; the next waits for its first token
                nursery.start_soon(run_to_end, fleet.router, chat(f"{LONG_PROMPT} {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert lender.borrowed_prefilling == 1 and fleet.router.statistics().pool("batch").queue.waiting == 1
            nursery.cancel_scope.cancel()


async def test_a_lender_without_own_requests_lately_lends_prompts_over_its_length_bound(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), max_prompt_tokens=200))
    async with router_over_engines(config) as fleet:
        seated: dict[str, str] = {}

        async def job(request_id: str, text: str) -> None:
            _, routing = await run_to_end(fleet.router, chat(text, max_tokens=LONG_OUTPUT, request_id=request_id))
            seated[request_id] = routing.endpoint

        async with trio.open_nursery() as nursery:
            nursery.start_soon(job, "own-seat", "a job")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(job, "idle-lender", LONG_PROMPT)  # nobody of the lender's own to stall: lent
            await trio.testing.wait_all_tasks_blocked()
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="own"))  # now it has
        async with trio.open_nursery() as nursery:
            nursery.start_soon(job, "own-seat-2", "a job")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(job, "busy-lender", LONG_PROMPT)  # over 200 tokens while its own are about: waits
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("batch").queue.waiting == 1
    assert seated["idle-lender"] == INTERACTIVE_URL and seated["busy-lender"] == BATCH_URL
