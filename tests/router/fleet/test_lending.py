"""Work-conserving pools: idle seats lent across pools, per-class seat limits, vLLM priority (virtual time)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import httpx
import pytest
import trio

from tailguard.router.admission import prefix_key_of
from tailguard.router.config import Config, ConfigError, LendConfig, ObjectiveConfig, parse_config
from tailguard.router.fleet import rendezvous_order
from tailguard.router.observe import RequestRecord
from tailguard.server.metrics import Metrics
from tailguard.sim.canned import canned_transport
from tests.helpers.config_text import BASE
from tests.helpers.engines import MODEL
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest

LONG_OUTPUT = 400  # over the interactive class's 128: a batch request


def lending_config(*, interactive_cap: int = 4, batch_cap: int = 2, lend: LendConfig, **changes: object) -> Config:
    """Interactive lends to batch under ``lend``; both classes wait long enough to be served."""
    base = two_pool_config(interactive_cap=interactive_cap, batch_cap=batch_cap, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    interactive = dataclasses.replace(interactive, lend=lend, **changes)  # type: ignore[arg-type]
    return with_digest(base, "lending", pools=(interactive, batch))


async def test_idle_interactive_seats_serve_batch_within_max_seats(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(lend=LendConfig(to=("batch",), max_seats=2, reserve=1))
    async with router_over_engines(config) as fleet:
        endpoints: list[str] = []

        async def batch_request(i: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
            assert routing.request_class == "batch" and routing.pool == "batch"
            endpoints.append(routing.endpoint)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(batch_request, i)
            await trio.testing.wait_all_tasks_blocked()
            interactive, batch = fleet.router.statistics().pool("interactive"), fleet.router.statistics().pool("batch")
            # batch's own 2 seats, 2 borrowed (max_seats), the fifth waits
            assert (batch.in_flight, batch.queue.waiting, interactive.in_flight) == (2, 1, 2)
            # interactive still seats its own at once: 4 seats, 2 lent
            _, routing = await run_to_end(fleet.router, chat("quick?", max_tokens=16, request_id="i0"))
            assert routing.pool == "interactive" and routing.queue_seconds == 0
        assert endpoints.count(INTERACTIVE_URL) >= 2 and len(endpoints) == 5
        page = Metrics(fleet.router).render().decode()
        assert f'tailguard_pool_borrowed_total{{lender="interactive",pool="batch"}} {endpoints.count(INTERACTIVE_URL):.1f}' in page
        assert 'tailguard_pool_lent_seats{pool="interactive"} 0.0' in page
        assert fleet.engine(INTERACTIVE_URL).statistics().max_running_seen <= 4
        assert fleet.engine(BATCH_URL).statistics().max_running_seen <= 2
        stats = fleet.router.statistics()
        assert stats.pool("interactive").in_flight == stats.pool("batch").in_flight == 0


async def test_seats_borrowed_from_a_lender_count_in_the_borrowers_drain_rate(autojump_clock: trio.testing.MockClock) -> None:
    """A borrower's requests seated on a lender free seats for its queue too: its drain rate (what fail-fast and
    Retry-After read) counts them, so a pool that borrows half its service does not refuse at arrival what the
    lender would serve in time. The count is back to zero when they end."""
    config = lending_config(lend=LendConfig(to=("batch",), max_seats=2, reserve=1))
    async with router_over_engines(config) as fleet:
        batch = fleet.router.pool("batch")

        checked = 0

        async def batch_requests(round_: int) -> None:
            nonlocal checked
            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(run_to_end, fleet.router, chat(f"job {round_}-{i}", max_tokens=LONG_OUTPUT, request_id=f"b{round_}-{i}"))
                await trio.testing.wait_all_tasks_blocked()
                stats = fleet.router.statistics().pool("batch")
                # batch's own 2 seats and 2 borrowed taken, the fifth waits: 4 seats serve its queue
                assert (stats.in_flight, batch.lending.borrowed, stats.queue.waiting) == (2, 2, 1)
                if stats.seat_seconds is not None:  # once enough seats were held and freed to tell
                    assert stats.drain_rate == pytest.approx((2 + 2) / stats.seat_seconds)
                    checked += 1

        for round_ in range(30):
            await batch_requests(round_)
            assert batch.lending.borrowed == 0
        assert checked > 10


async def test_the_reserve_is_never_lent_and_the_lenders_own_requests_win_the_next_seat(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(interactive_cap=3, lend=LendConfig(to=("batch",), reserve=1))
    async with router_over_engines(config) as fleet:
        seated: list[str] = []

        async def one(request_id: str, max_tokens: int) -> None:
            await run_to_end(fleet.router, chat(f"text {request_id}", max_tokens=max_tokens, request_id=request_id))
            seated.append(request_id)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, f"b{i}", LONG_OUTPUT)
            await trio.testing.wait_all_tasks_blocked()
            stats = fleet.router.statistics()
            # 2 of batch's own, 2 lent (3 seats minus the reserve of 1), 2 waiting
            assert (stats.pool("batch").in_flight, stats.pool("interactive").in_flight, stats.pool("batch").queue.waiting) == (2, 2, 2)
            for i in range(3):  # the reserve seats one; two wait for interactive seats
                nursery.start_soon(one, f"i{i}", 16)
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("interactive").queue.waiting == 2
        # Every interactive request finished before the batch requests waiting beside them were seated:
        # a freed interactive seat went to interactive's own waiters, never lent again meanwhile.
        assert seated.index("i1") < seated.index("b5") and seated.index("i2") < seated.index("b5")


async def test_a_prompt_over_the_prefill_budget_is_never_lent(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), max_prompt_tokens=200))
    async with router_over_engines(config) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="own"))  # the lender has own requests lately
        endpoints: dict[str, str] = {}

        async def one(request_id: str, text: str) -> None:
            _, routing = await run_to_end(fleet.router, chat(text, max_tokens=LONG_OUTPUT, request_id=request_id))
            endpoints[request_id] = routing.endpoint

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", "short job")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "long-prompt", "word " * 2000)  # ~2,500 tokens: over the budget
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "small-prompt", "another short job")  # behind it in line, but it fits
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("batch").queue.waiting == 1  # only the long prompt waits
        assert endpoints == {"first": BATCH_URL, "small-prompt": INTERACTIVE_URL, "long-prompt": BATCH_URL}


async def test_without_lend_rules_a_pool_lends_nothing(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(batch_cap=1, lend=LendConfig())
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("interactive").in_flight == 0
            assert fleet.router.statistics().pool("batch").queue.waiting == 2


async def test_a_class_limit_keeps_seats_of_a_shared_pool_for_the_other_class(autojump_clock: trio.testing.MockClock) -> None:
    base = two_pool_config(batch_cap=4, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    batch = dataclasses.replace(batch, class_max_concurrency=(("batch", 2),))
    classes = tuple(dataclasses.replace(c, pool="batch") for c in base.classes)
    config = with_digest(base, "shared", pools=(interactive, batch), classes=classes)
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
            await trio.testing.wait_all_tasks_blocked()
            pool = fleet.router.statistics().pool("batch")
            assert (pool.in_flight, pool.queue.waiting) == (2, 3)  # batch holds at most 2 of the 4 seats
            for i in range(2):  # interactive requests queued behind them are seated at once
                _, routing = await run_to_end(fleet.router, chat("quick?", max_tokens=16, request_id=f"i{i}"))
                assert routing.queue_seconds == 0
        assert fleet.engine(BATCH_URL).statistics().max_running_seen <= 4


async def test_vllm_priority_is_sent_only_where_the_pool_asks_for_it(autojump_clock: trio.testing.MockClock) -> None:
    base = two_pool_config()
    interactive, batch = base.pools
    config = with_digest(base, "priority", pools=(interactive, dataclasses.replace(batch, vllm_priority=True)))
    sent: dict[str, object] = {}

    def recording(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        """Each endpoint's completion calls, their bodies seen on the way."""

        async def record(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and url in (INTERACTIVE_URL, BATCH_URL):
                sent[url] = json.loads(request.content).get("priority", "absent")
            return await inner.handle_async_request(request)

        return canned_transport(record)

    async with router_over_engines(config, wrap=recording) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=16, request_id="i"))
        await run_to_end(fleet.router, chat("long job", max_tokens=LONG_OUTPUT, request_id="b"))
        assert sent == {INTERACTIVE_URL: "absent", BATCH_URL: 1}  # the batch class's priority


@pytest.mark.parametrize(
    ("addition", "needle"),
    [
        ('[pools.interactive.lend]\nto = ["nope"]\n', 'names no defined pool: "nope"'),
        ('[pools.interactive.lend]\nto = ["interactive"]\n', "cannot lend to itself"),
        ('[pools.interactive.lend]\nto = ["batch"]\nreserve = 64\n', "leaves nothing to lend"),
        ('[pools.interactive.lend]\nto = ["batch"]\nmax_prompt = 5\n', "unknown key"),
        ('[pools.batch.class_max_concurrency]\nnope = 3\n', 'names no defined class: "nope"'),
        ('[pools.batch.class_max_concurrency]\nbatch = 0\n', "batch"),
    ],
)
def test_lending_and_class_limit_mistakes_are_named(addition: str, needle: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + "\n" + addition)
    assert needle in str(raised.value)


def test_lending_rules_read_from_the_file() -> None:
    text = BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nmax_seats = 8\nreserve = 4\nmax_prompt_tokens = 512\n'
    text += "\n[pools.batch.class_max_concurrency]\nbatch = 48\n"
    config = parse_config(text)
    assert config.pool("interactive").lend == LendConfig(to=("batch",), max_seats=8, reserve=4, max_prompt_tokens=512)
    assert config.pool("batch").class_limit("batch") == 48 and config.pool("batch").class_limit("interactive") is None


BATCH_URLS = (BATCH_URL, "http://batch-1:8000")


def lend_back_config() -> Config:
    """Interactive has one seat; batch has two endpoints of 4 and lends its idle seats back to interactive requests."""
    base = two_pool_config(interactive_cap=1, batch_cap=4, batch_urls=BATCH_URLS, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    return with_digest(base, "lend-back", pools=(interactive, dataclasses.replace(batch, lend=LendConfig(to=("interactive",)))))


def with_batch_promised(config: Config) -> Config:
    """``config`` with its batch class promised a first token: the batch pool then keeps what it lends apart (``Pool.isolates_lent``)."""
    interactive, batch = config.classes
    promised = dataclasses.replace(batch, objective=ObjectiveConfig(ttft=1.0, itl=0.1, e2e=120.0))
    return with_digest(config, f"{config.digest}-batch-promised", classes=(interactive, promised))


async def test_a_lender_promised_a_first_token_packs_borrowed_seats_onto_one_endpoint(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(with_batch_promised(lend_back_config())) as fleet:
        endpoints = [fleet.router.endpoint(url) for url in BATCH_URLS]
        async with trio.open_nursery() as nursery:
            for i in range(4):  # the first takes interactive's one seat, the other three borrow batch seats
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            # least loaded would have spread them 2 / 1; they share one engine, the other keeps none
            assert sorted((e.borrowed, e.in_flight) for e in endpoints) == [(0, 0), (3, 3)]
            assert fleet.router.statistics().pool("batch").in_flight == 3
        assert [e.borrowed for e in endpoints] == [0, 0]


async def test_a_lender_promised_only_an_end_places_borrowed_seats_by_load(autojump_clock: trio.testing.MockClock) -> None:
    # The shipped batch class has no ttft: nothing of its own to keep apart, so lent seats spread like its own.
    async with router_over_engines(lend_back_config()) as fleet:
        endpoints = [fleet.router.endpoint(url) for url in BATCH_URLS]
        assert not fleet.router.pool("batch").isolates_lent
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert sorted((e.borrowed, e.in_flight) for e in endpoints) == [(1, 1), (2, 2)]
        assert [e.borrowed for e in endpoints] == [0, 0]


async def own_and_borrowed_after_three_jobs(config: Config) -> tuple[tuple[int, int], tuple[int, int]]:
    """Interactive's own seat and one borrowed batch seat, then three batch jobs: (in flight, borrowed) of the lent endpoint and the other."""
    async with router_over_engines(config) as fleet:
        by_url = {url: fleet.router.endpoint(url) for url in BATCH_URLS}
        async with trio.open_nursery() as nursery:
            for i in range(2):  # interactive's own seat, then one borrowed on a batch endpoint
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=128, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            lent = next(e for e in by_url.values() if e.borrowed)
            clear = next(e for e in by_url.values() if e is not lent)
            for i in range(3):
                nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
                await trio.testing.wait_all_tasks_blocked()
            seen = (lent.in_flight, lent.borrowed), (clear.in_flight, clear.borrowed)
            assert fleet.router.statistics().pool("batch").queue.waiting == 0
            nursery.cancel_scope.cancel()
        assert [e.borrowed for e in by_url.values()] == [0, 0]
        assert fleet.router.pool("batch").lending.lent == 0
    return seen


async def test_a_promised_lenders_own_requests_avoid_borrowed_seats_while_another_endpoint_has_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Batch's own go to the other endpoint, though the lent one is less loaded (1 < 2).
    assert await own_and_borrowed_after_three_jobs(with_batch_promised(lend_back_config())) == ((1, 1), (3, 0))
    # Promised only an end, they go by load: 2 and 2.
    assert await own_and_borrowed_after_three_jobs(lend_back_config()) == ((2, 1), (2, 0))


def refusing_once(refused: list[str]) -> Callable[[str, httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap``: the first completion call to a batch endpoint is refused before any response (its URL into ``refused``)."""

    def wrap(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        if url not in BATCH_URLS:
            return inner

        async def refuse_once(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and not refused:
                refused.append(url)
                raise httpx.ConnectError("connection refused", request=request)
            return await inner.handle_async_request(request)

        return canned_transport(refuse_once)

    return wrap


async def test_a_retry_carries_the_borrowed_count_to_the_new_endpoint(autojump_clock: trio.testing.MockClock) -> None:
    refused: list[str] = []
    async with router_over_engines(lend_back_config(), wrap=refusing_once(refused)) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(2):  # interactive's own seat, then one borrowed, refused on its first endpoint
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert len(refused) == 1
            first, second = (fleet.router.endpoint(url) for url in sorted(BATCH_URLS, key=lambda u: u != refused[0]))
            assert (first.borrowed, first.in_flight, second.borrowed, second.in_flight) == (0, 0, 1, 1)
            assert first.context_tokens == 0 and second.context_tokens > 64  # the context moved with the seat
            # the pool's own request goes by load: to the endpoint the borrowed seat left
            nursery.start_soon(run_to_end, fleet.router, chat("job", max_tokens=LONG_OUTPUT, request_id="b"))
            await trio.testing.wait_all_tasks_blocked()
            assert (first.in_flight, second.in_flight) == (1, 1)
        assert (first.borrowed, second.borrowed, first.in_flight, second.in_flight) == (0, 0, 0, 0)
        assert (first.context_tokens, second.context_tokens) == (0, 0)


async def test_a_pool_with_no_usable_endpoint_borrows_before_it_answers_no_backend(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 20: with the interactive engine down, every chat request got 503 no_backend at once while
    the batch pool's lend-back seats stayed idle."""
    from tailguard.router.errors import NoBackend
    from tailguard.router.observe import RequestRecord
    from tests.router.backend.test_real_vllm import complete, engines, router_over

    down, up = "http://down-0:8000", "http://up-0:8000"

    async def dead(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    text = f"""
[pools.interactive]
max_model_len = 32768
models = ["{MODEL}"]
endpoints = [{{ url = "{down}", max_concurrency = 4 }}]
[pools.batch]
max_model_len = 32768
models = ["{MODEL}"]
endpoints = [{{ url = "{up}", max_concurrency = 4 }}]
[pools.batch.lend]
to = ["interactive"]
max_prompt_tokens = 100
[classes.interactive]
pool = "interactive"
max_output_tokens = 128
queue_timeout = 3.0
[classes.batch]
pool = "batch"
queue_timeout = 30.0
"""
    async with engines(None) as [app], router_over({down: dead, up: app}, parse_config(text)) as router:
        for _ in range(3):  # the pool's unhealthy_threshold (default 3): three failed probes in a row
            await router.check_health()
        assert router.health()["pools"]["interactive"]["healthy"] is False
        record = RequestRecord("chat", "http", trio.current_time())
        assert json.loads(await complete(router, chat("hi", max_tokens=8, request_id="chat"), record))["choices"]
        assert (record.pool, record.lender, record.endpoint) == ("interactive", "batch", up)
        await complete(router, chat("a job", max_tokens=256, request_id="own"))  # the lender's own request: its bounds hold
        with pytest.raises(NoBackend):  # one the lender's rules refuse (a prompt over its 100 tokens) is told at once
            await complete(router, chat("word " * 400, max_tokens=8, request_id="long"))


async def test_a_borrowed_conversation_keeps_to_its_home_among_the_lenders_engines(autojump_clock: trio.testing.MockClock) -> None:
    """No seat lent at the moment: each borrowed request starts the pack at its key's home, so a conversation keeps one cache."""
    async with router_over_engines(lend_back_config()) as fleet:
        lender = [fleet.router.endpoint(url) for url in BATCH_URLS]
        conversations: dict[str, str] = {}
        for n in range(40):  # one conversation homed on each lender engine
            request = chat("hi", params={"prompt_cache_key": f"conversation-{n}"})
            key = prefix_key_of(request)
            assert key is not None
            conversations.setdefault(rendezvous_order(key, lender)[0].url, f"conversation-{n}")
        assert set(conversations) == set(BATCH_URLS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("holding the seat", max_tokens=128, request_id="hold"))
            await trio.testing.wait_all_tasks_blocked()  # interactive's one seat is taken: the rest borrow
            for home, conversation in conversations.items():
                for turn in range(3):
                    request = chat(f"turn {turn}", max_tokens=4, request_id=f"{conversation}-{turn}", params={"prompt_cache_key": conversation})
                    record = RequestRecord(request.request_id, "http", trio.current_time())
                    with trio.CancelScope(deadline=fleet.router.deadline_for(request)):
                        async with fleet.router.open(request, record=record) as completion:
                            await completion.read()
                    assert (record.endpoint, record.placement, record.lender) == (home, "borrowed", "batch")


async def test_a_lenders_freed_seat_goes_to_a_more_urgent_borrower_before_its_own_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One seat each; batch lends back. A short request waits for interactive's seat and a batch job for batch's:
    # when batch's seat frees, the short request (priority 0) takes it before batch's own job (priority 1).
    base = two_pool_config(interactive_cap=1, batch_cap=1, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    config = with_digest(base, "lend-back-urgent", pools=(interactive, dataclasses.replace(batch, lend=LendConfig(to=("interactive",)))))
    document = "word " * 600  # ~750 tokens: over the interactive class's prompt bound, a batch job
    seated: dict[str, tuple[str, float]] = {}
    async with router_over_engines(config) as fleet:

        async def send(request_id: str, prompt: str, max_tokens: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(prompt, max_tokens=max_tokens, request_id=request_id))
            seated[request_id] = (routing.endpoint, routing.queue_seconds)

        async with trio.open_nursery() as nursery:
            for request_id, prompt, max_tokens in (("short-running", "quick?", 128), ("job-running", document, 4), ("job-waiting", document, 4), ("short-waiting", "quick again?", 8)):
                nursery.start_soon(send, request_id, prompt, max_tokens)
                await trio.testing.wait_all_tasks_blocked()
            waiting = fleet.router.statistics()
            assert waiting.pool("interactive").queue.waiting == 1 and waiting.pool("batch").queue.waiting == 1
    assert seated["short-waiting"][0] == BATCH_URL  # lent the freed seat (before: batch's own job took it)
    assert seated["job-waiting"][0] == BATCH_URL and seated["job-waiting"][1] > seated["short-waiting"][1]
