"""Lending ``when = "busier"``: a borrower takes a lender's seat while the lender's engine is the less full one (virtual time)."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from tailguard.router.config import Config, ConfigError, LendConfig, LimitsConfig, ObjectiveConfig, parse_config, render_config
from tailguard.router.fleet import RecentMean, RecentPeak
from tests.helpers.config_text import BASE
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest
from tests.router.fleet.test_lend_prefills import LONG_PROMPT
from tests.router.fleet.test_lending import LONG_OUTPUT, lending_config

# Over the 200-token prompt bound, yet with LONG_OUTPUT under the context of one seat (Endpoint.fill counts
# CONTEXT_TOKENS_A_SEAT tokens as a seat): these tests weigh seats and queued prefill, not long contexts.
MID_PROMPT = "word " * 200  # ~250 tokens


async def endpoints_of_batch_jobs(
    lend: LendConfig, jobs: int, *, prompt: str = "job", warm: bool = False
) -> tuple[list[str], dict[str, int]]:
    """Where each of ``jobs`` batch requests, sent one after another and all still running, was seated; and the in-flight counts then.

    ``warm``: one own interactive request ran first, so the lender has had own traffic lately and its stall bounds hold.
    """
    config = lending_config(interactive_cap=4, batch_cap=4, lend=lend)
    seated: list[str] = []
    async with router_over_engines(config) as fleet:
        if warm:
            await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="own"))

        async def job(i: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(f"{prompt} {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
            seated.append(routing.endpoint)

        in_flight: dict[str, int] = {}
        async with trio.open_nursery() as nursery:
            for i in range(jobs):
                nursery.start_soon(job, i)
                await trio.testing.wait_all_tasks_blocked()
            in_flight = {url: fleet.router.endpoint(url).in_flight for url in (INTERACTIVE_URL, BATCH_URL)}
    return seated, in_flight


async def test_busier_lends_whenever_the_lenders_engine_is_less_full(autojump_clock: trio.testing.MockClock) -> None:
    # Both engines have 4 seats: a job goes where it leaves the smaller share of seats taken, the borrower's own on a tie.
    _, in_flight = await endpoints_of_batch_jobs(LendConfig(to=("batch",), when="busier"), 4)
    assert in_flight == {INTERACTIVE_URL: 2, BATCH_URL: 2}


async def test_full_lends_only_once_the_borrower_has_no_seat(autojump_clock: trio.testing.MockClock) -> None:
    _, in_flight = await endpoints_of_batch_jobs(LendConfig(to=("batch",)), 5)
    assert in_flight == {INTERACTIVE_URL: 1, BATCH_URL: 4}


async def test_busier_counts_the_reserve_on_the_lenders_side(autojump_clock: trio.testing.MockClock) -> None:
    # With 2 of its 4 seats kept, the lender looks 3/4 full with one borrowed: batch fills to 4 before the fifth borrows.
    _, in_flight = await endpoints_of_batch_jobs(LendConfig(to=("batch",), reserve=2, when="busier"), 5)
    assert in_flight == {INTERACTIVE_URL: 1, BATCH_URL: 4}


async def test_busier_takes_the_borrowers_own_seat_while_the_lender_is_at_its_prefill_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # With its own request a moment ago the lender keeps one seat and its bound holds. The third long job is lent
    # (batch 3/4 against 2/4), the fourth ties (3/4 each) and stays; the fifth would be lent (1.0 against 3/4), but
    # the third's prefill is still running there: it takes batch's own last seat at once rather than waiting.
    # Without the bound it is lent.
    bound = LendConfig(to=("batch",), prefills=1, when="busier")
    _, in_flight = await endpoints_of_batch_jobs(bound, 5, prompt=LONG_PROMPT, warm=True)
    assert in_flight == {INTERACTIVE_URL: 1, BATCH_URL: 4}
    _, in_flight = await endpoints_of_batch_jobs(LendConfig(to=("batch",), when="busier"), 5, prompt=LONG_PROMPT, warm=True)
    assert in_flight == {INTERACTIVE_URL: 2, BATCH_URL: 3}


async def test_busier_lends_nothing_while_the_lenders_own_request_waits(autojump_clock: trio.testing.MockClock) -> None:
    config = lending_config(interactive_cap=1, batch_cap=4, lend=LendConfig(to=("batch",), when="busier"))
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(2):  # interactive's one seat taken, a second interactive request waits for it
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run_to_end, fleet.router, chat("job", max_tokens=LONG_OUTPUT, request_id="b"))
            await trio.testing.wait_all_tasks_blocked()
            stats = fleet.router.statistics()
            assert stats.pool("interactive").queue.waiting == 1 and stats.pool("batch").in_flight == 1
            assert fleet.router.endpoint(INTERACTIVE_URL).borrowed == 0


def test_when_is_read_checked_and_rendered() -> None:
    config = parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nwhen = "busier"\n')
    assert config.pool("interactive").lend == LendConfig(to=("batch",), when="busier")
    assert "to batch, whenever the borrower is busier" in render_config(config)
    assert parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\n').pool("interactive").lend.when == "full"
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nwhen = "always"\n')
    assert "pools.interactive.lend.when" in str(raised.value)


async def borrowed_after_an_own_request(lend: LendConfig, *, stream: bool, pause: float = 0.0) -> tuple[int, int]:
    """One own interactive request runs to its end, ``pause`` s pass, then two batch jobs: (lent, waiting) with both sent."""
    config = lending_config(batch_cap=1, lend=lend)
    async with router_over_engines(config) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, stream=stream, request_id="own"))
        await trio.sleep(pause)
        async with trio.open_nursery() as nursery:
            for i in range(2):  # batch's one seat, then one that may borrow
                nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
                await trio.testing.wait_all_tasks_blocked()
            answer = (fleet.router.endpoint(INTERACTIVE_URL).borrowed, fleet.router.statistics().pool("batch").queue.waiting)
            nursery.cancel_scope.cancel()
    return answer


async def test_an_endpoint_over_its_ttft_budget_lends_nothing(autojump_clock: trio.testing.MockClock) -> None:
    # Any real first byte takes more than a microsecond: the own stream puts the lender over budget.
    assert await borrowed_after_an_own_request(LendConfig(to=("batch",), ttft_budget=1e-6), stream=True) == (0, 1)
    assert await borrowed_after_an_own_request(LendConfig(to=("batch",), ttft_budget=10.0), stream=True) == (1, 0)


async def test_the_ttft_budget_reads_own_streams_only_and_forgets_stale_evidence(autojump_clock: trio.testing.MockClock) -> None:
    tight = LendConfig(to=("batch",), ttft_budget=1e-6)
    assert await borrowed_after_an_own_request(tight, stream=False) == (1, 0)  # a whole answer is no first token
    assert await borrowed_after_an_own_request(tight, stream=True, pause=6.0) == (1, 0)  # 6 s without an own stream


def test_ttft_budget_is_read_checked_and_rendered() -> None:
    config = parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nttft_budget = 0.05\n')
    assert config.pool("interactive").lend.ttft_budget == 0.05
    assert "first byte comes within" in render_config(config)
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + '\n[pools.interactive.lend]\nto = ["batch"]\nttft_budget = 0\n')
    assert "pools.interactive.lend.ttft_budget" in str(raised.value)


async def test_the_prompt_bound_yields_while_the_borrower_is_fuller_by_over_max_imbalance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Both engines have 4 seats and prompts over the bound: the third job would make batch 3/4 full against the
    # lender's 1/4, an imbalance of 1/2 over the 1/4 allowed, so it is lent; the fourth (3/4 against 2/4) is not.
    bounded = LendConfig(to=("batch",), when="busier", max_prompt_tokens=200)
    _, held = await endpoints_of_batch_jobs(bounded, 4, prompt=MID_PROMPT, warm=True)
    assert held == {INTERACTIVE_URL: 0, BATCH_URL: 4}
    _, yielded = await endpoints_of_batch_jobs(dataclasses.replace(bounded, max_imbalance=0.25), 4, prompt=MID_PROMPT, warm=True)
    assert yielded == {INTERACTIVE_URL: 1, BATCH_URL: 3}
    _, short = await endpoints_of_batch_jobs(dataclasses.replace(bounded, max_imbalance=0.25), 4, warm=True)
    assert short == {INTERACTIVE_URL: 1, BATCH_URL: 3}  # short prompts: "busier" alone, the reserve of 1 its own peak


def test_max_imbalance_is_read_checked_and_rendered() -> None:
    lend = '\n[pools.interactive.lend]\nto = ["batch"]\nmax_prompt_tokens = 512\n'
    config = parse_config(BASE + lend + "max_imbalance = 0.2\n")
    assert config.pool("interactive").lend.max_imbalance == 0.2
    assert "fuller by over 0.2 of the seats" in render_config(config)
    assert parse_config(BASE + lend).pool("interactive").lend.max_imbalance is None
    for bad in ("0", "1.5", '"high"'):
        with pytest.raises(ConfigError) as raised:
            parse_config(BASE + lend + f"max_imbalance = {bad}\n")
        assert "pools.interactive.lend.max_imbalance" in str(raised.value)


async def in_flight_after_an_own_burst(burst: int, pause: float) -> dict[str, int]:
    """``burst`` own interactive requests run together and end, ``pause`` s pass, then 4 batch jobs under "busier": the in-flight counts."""
    config = lending_config(interactive_cap=4, batch_cap=4, lend=LendConfig(to=("batch",), when="busier"))
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(burst):
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=8, request_id=f"i{i}"))
        await trio.sleep(pause)
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=LONG_OUTPUT, request_id=f"b{i}"))
                await trio.testing.wait_all_tasks_blocked()
            counts = {url: fleet.router.endpoint(url).in_flight for url in (INTERACTIVE_URL, BATCH_URL)}
            nursery.cancel_scope.cancel()
    return counts


async def test_busier_keeps_free_what_the_lenders_own_requests_held_lately(autojump_clock: trio.testing.MockClock) -> None:
    # 3 of its 4 seats were its own a moment ago: lending one more would leave fewer than 3 free.
    assert await in_flight_after_an_own_burst(3, pause=1.0) == {INTERACTIVE_URL: 0, BATCH_URL: 4}
    assert await in_flight_after_an_own_burst(1, pause=1.0) == {INTERACTIVE_URL: 1, BATCH_URL: 3}  # one seat kept: the 4th job ties at 3/4 and stays
    assert await in_flight_after_an_own_burst(3, pause=61.0) == {INTERACTIVE_URL: 2, BATCH_URL: 2}  # a peak 2 windows old is forgotten


async def seat_of_a_job_behind_a_long_prompt(*, streamed: bool) -> str:
    """Batch's engine is prefilling a prompt (streamed or not); where a small batch job goes under "busier" with reserve 2 of 4."""
    config = lending_config(interactive_cap=4, batch_cap=4, lend=LendConfig(to=("batch",), reserve=2, when="busier"))
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            long_job = chat(MID_PROMPT, max_tokens=LONG_OUTPUT, stream=streamed, request_id="long")
            nursery.start_soon(run_to_end, fleet.router, long_job)
            await trio.testing.wait_all_tasks_blocked()
            _, routing = await run_to_end(fleet.router, chat("small job", max_tokens=LONG_OUTPUT, request_id="small"))
            nursery.cancel_scope.cancel()
    return routing.endpoint


async def test_busier_lends_when_the_borrowers_engine_has_more_prompt_queued_for_prefill(autojump_clock: trio.testing.MockClock) -> None:
    # By seats alone batch is the less full (2/4 against the lender's 3/4 with its reserve): the queued prefill decides.
    assert await seat_of_a_job_behind_a_long_prompt(streamed=True) == INTERACTIVE_URL
    # A whole answer's prefill is not seen (its first byte is its end): by seats, it stays home.
    assert await seat_of_a_job_behind_a_long_prompt(streamed=False) == BATCH_URL


async def test_a_waiting_borrower_is_seated_when_the_ttft_evidence_goes_stale(autojump_clock: trio.testing.MockClock) -> None:
    # No seat frees when a bound lifts with time alone: a timer offers the lender's idle seats then.
    config = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), ttft_budget=1e-6))
    async with router_over_engines(config) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, stream=True, request_id="own"))  # over budget
        seated_at: dict[str, tuple[str, float]] = {}

        async def job(request_id: str) -> None:
            _, routing = await run_to_end(fleet.router, chat(f"job {request_id}", max_tokens=4000, request_id=request_id))
            seated_at[request_id] = (routing.endpoint, routing.queue_seconds)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for request_id in ("first", "second"):  # batch's one seat; the second waits: the lender is over budget
                nursery.start_soon(job, request_id)
                await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("batch").queue.waiting == 1
    lender, waited = seated_at["second"]
    assert lender == INTERACTIVE_URL and waited <= RecentMean.STALE_AFTER  # seated when the evidence went stale...
    assert seated_at["first"][0] == BATCH_URL and started + waited < started + 30  # ...long before batch's seat freed


async def test_a_waiting_borrower_is_seated_when_the_lenders_own_peak_is_forgotten(autojump_clock: trio.testing.MockClock) -> None:
    base = lending_config(batch_cap=1, lend=LendConfig(to=("batch",), max_prompt_tokens=200))
    classes = tuple(dataclasses.replace(k, queue_timeout=100.0) for k in base.classes)  # longer than the peak lasts
    config = dataclasses.replace(base, limits=LimitsConfig(output_cap_tokens=10_000), classes=classes)
    async with router_over_engines(config) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="own"))  # its own, lately: the bound holds
        seated: dict[str, tuple[str, float]] = {}

        async def job(request_id: str, text: str, max_tokens: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(text, max_tokens=max_tokens, request_id=request_id))
            seated[request_id] = (routing.endpoint, routing.queue_seconds)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(job, "hold", "a long job", 10_000)  # batch's one seat, for longer than the peak lasts (~80 s)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(job, "long-prompt", LONG_PROMPT, 8)  # over 200 tokens: waits while the peak stands
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("batch").queue.waiting == 1
    endpoint, waited = seated["long-prompt"]
    assert endpoint == INTERACTIVE_URL and waited <= 2 * RecentPeak.WINDOW


def lend_back_busier() -> Config:
    """Interactive (4 seats, its class promised a first token) borrows batch's engine (4 seats) whenever that one is the less busy."""
    base = two_pool_config(
        interactive_cap=4, batch_cap=4, interactive_timeout=60.0, batch_timeout=60.0, limits=LimitsConfig(output_cap_tokens=10_000)
    )
    interactive_pool, batch_pool = base.pools
    interactive, batch = base.classes
    promised = dataclasses.replace(interactive, objective=ObjectiveConfig(ttft=1.0, itl=0.1, e2e=30.0))
    lends_back = dataclasses.replace(batch_pool, lend=LendConfig(to=("interactive",), when="busier"))
    return with_digest(base, "lend-back-busier", pools=(interactive_pool, lends_back), classes=(promised, batch))


async def where_a_short_request_goes(batch_prompt: str, batch_max_tokens: int, *, batch_streamed: bool = False) -> str:
    """One batch job runs on batch's engine and two short requests on interactive's; where a third short one is seated."""
    async with router_over_engines(lend_back_busier()) as fleet:
        async with trio.open_nursery() as nursery:
            job = chat(batch_prompt, max_tokens=batch_max_tokens, stream=batch_streamed, request_id="job")
            nursery.start_soon(run_to_end, fleet.router, job)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(2):
                nursery.start_soon(run_to_end, fleet.router, chat(f"quick {i}?", max_tokens=64, request_id=f"i{i}"))
                await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.endpoint(BATCH_URL).in_flight == 1 and fleet.router.endpoint(INTERACTIVE_URL).in_flight == 2
            _, routing = await run_to_end(fleet.router, chat("quick?", max_tokens=64, request_id="short"))
            nursery.cancel_scope.cancel()
    return routing.endpoint


async def test_a_short_request_borrows_the_less_busy_engine_counting_the_context_its_requests_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Batch's engine at 2/4 with it against interactive's 3/4: lent.
    assert await where_a_short_request_goes("job", LONG_OUTPUT) == BATCH_URL
    # One job of ~5,000 tokens of context costs a step what ~8 short sequences do: batch's engine is the busier, though
    # by seats it holds one (before: lent by seats alone).
    assert await where_a_short_request_goes("job", 5_000) == INTERACTIVE_URL


async def test_a_request_promised_a_first_token_borrows_only_an_engine_with_no_longer_prefill_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Batch's engine is the cheaper step (2/4 against 3/4) but is prefilling a ~250-token prompt that interactive's
    # is not: the short request's first token would wait behind it, so it stays home (before: lent for the step).
    assert await where_a_short_request_goes(MID_PROMPT, LONG_OUTPUT, batch_streamed=True) == INTERACTIVE_URL


async def test_a_request_of_several_sequences_weighs_them_all_on_the_borrowers_side_too(autojump_clock: trio.testing.MockClock) -> None:
    # Interactive's engine holds one short request (1/4), batch's none. Two sequences would make it 3/4 at home against
    # 2/4 on batch's: lent (and classed interactive still). Before, the borrower's side counted one seat (2/4, a tie): kept home.
    async with router_over_engines(lend_back_busier()) as fleet:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("quick?", max_tokens=64, request_id="i0"))
            await trio.testing.wait_all_tasks_blocked()
            _, routing = await run_to_end(fleet.router, chat("three ways?", max_tokens=64, request_id="n2", params={"n": 2}))
            nursery.cancel_scope.cancel()
    assert routing.request_class == "interactive" and routing.endpoint == BATCH_URL
