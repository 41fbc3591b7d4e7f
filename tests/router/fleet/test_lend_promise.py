"""Lending kept within the lender's promise: a borrowed prompt may cost the lender's own next request only
``PROMISE_SHARE`` of its class's ttft objective, by the engine's first-byte model (virtual time)."""

from __future__ import annotations

import dataclasses

import trio

from tailguard.router import Router
from tailguard.router.config import Config, LendConfig, ObjectiveConfig, parse_config
from tailguard.router.fleet.lending import PROMISE_SHARE
from tests.helpers.config_text import edit
from tests.helpers.router import INTERACTIVE_URL, chat, router_over_engines, run_to_end, with_digest
from tests.router.fleet.test_lending import LONG_OUTPUT, lending_config

PROMISE = 0.5  # the interactive class's ttft objective, seconds
LONG_PROMPT = "word " * 2000  # ~2,500 tokens: the prior model (50 ms + 0.1 ms a token) predicts ~0.3 s, over 0.4 x 0.5 s
SHORT_PROMPT = "a short job"


def promised(lend: LendConfig) -> Config:
    """Interactive (4 seats, promised ``PROMISE`` s to a first token) lends to batch (1 seat) under ``lend``."""
    config = lending_config(batch_cap=1, lend=lend)
    interactive, batch = config.classes
    objective = ObjectiveConfig(ttft=PROMISE, itl=0.05, e2e=30.0)
    return with_digest(config, "lend-promise", classes=(dataclasses.replace(interactive, objective=objective), batch))


async def batch_streams(router: Router, prompts: dict[str, str], seated: dict[str, str]) -> None:
    """Each of ``prompts`` as a streamed batch request, started in turn; ``seated``: where each ran."""

    async def streamed(request_id: str, text: str) -> None:
        with trio.CancelScope(deadline=trio.current_time() + 60):
            async with router.open(chat(text, max_tokens=LONG_OUTPUT, stream=True, request_id=request_id)) as completion:
                async for _ in completion.chunks():
                    pass
                seated[request_id] = completion.routing.endpoint

    async with trio.open_nursery() as nursery:
        for request_id, text in prompts.items():
            nursery.start_soon(streamed, request_id, text)
            await trio.testing.wait_all_tasks_blocked()


async def test_a_prompt_the_lenders_promise_cannot_afford_waits_for_its_own_pool(autojump_clock: trio.testing.MockClock) -> None:
    """While the lender's own requests are about, a long borrowed prompt (predicted past 0.4 x the promise for the
    next own request) is not lent and waits for batch's seat; a short one behind it is lent at once."""
    async with router_over_engines(promised(LendConfig(to=("batch",)))) as fleet:
        lending = fleet.router.pool("interactive").lending
        assert (lending.promise, lending.by_promise) == (PROMISE, True)
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="warm"))  # own traffic lately
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        assert lender.first_byte_model.predict(2500) > PROMISE_SHARE * PROMISE > lender.first_byte_model.predict(10)
        seated: dict[str, str] = {}
        await batch_streams(fleet.router, {"own": SHORT_PROMPT, "long": LONG_PROMPT, "short": SHORT_PROMPT}, seated)
    assert seated["short"] == INTERACTIVE_URL  # lent past the long one, which its promise could not afford
    assert seated["long"] != INTERACTIVE_URL  # waited for batch's own seat


async def test_with_no_own_request_about_the_promise_binds_nothing(autojump_clock: trio.testing.MockClock) -> None:
    """Nobody of the lender's own is about: nobody waits behind a borrowed prompt, and the long one is lent."""
    async with router_over_engines(promised(LendConfig(to=("batch",)))) as fleet:
        seated: dict[str, str] = {}
        await batch_streams(fleet.router, {"own": SHORT_PROMPT, "long": LONG_PROMPT}, seated)
    assert seated["long"] == INTERACTIVE_URL


async def test_an_expert_bound_in_the_file_governs_instead_of_the_promise(autojump_clock: trio.testing.MockClock) -> None:
    """``max_prompt_tokens`` set: the stall bounds as written (a 2,500-token prompt over 4,000 is lent), not the promise."""
    async with router_over_engines(promised(LendConfig(to=("batch",), max_prompt_tokens=4000))) as fleet:
        assert not fleet.router.pool("interactive").lending.by_promise
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="warm"))
        seated: dict[str, str] = {}
        await batch_streams(fleet.router, {"own": SHORT_PROMPT, "long": LONG_PROMPT}, seated)
    assert seated["long"] == INTERACTIVE_URL


def test_the_promise_is_the_tightest_ttft_of_the_pools_own_classes() -> None:
    """Read from the file: the classes of the pool, their ttft objectives, the least of them."""
    chat_class = '[classes.chat]\npool = "interactive"\nqueue_timeout = 3.0\nmax_prompt_tokens = 100\nmax_output_tokens = 64\n'
    config = parse_config(edit("[classes.interactive]", f"{chat_class}[classes.chat.objective]\nttft = 0.25\n\n[classes.interactive]"))
    assert {c.name: c.objective.ttft for c in config.classes if c.pool == "interactive"}["chat"] == 0.25
    router = Router(config)
    assert router.pool("interactive").lending.promise == 0.25
    assert router.pool("batch").lending.promise is None  # the catch-all is promised its deadline alone


async def test_the_lenders_own_streams_pace_is_watched(autojump_clock: trio.testing.MockClock) -> None:
    """An own stream that ended leaves its mean seconds a token after the first on its endpoint: what lending by the
    itl promise reads."""
    async with router_over_engines(promised(LendConfig(to=("batch",)))) as fleet:
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        async with fleet.router.open(chat("quick?", max_tokens=32, stream=True, request_id="own")) as completion:
            async for _ in completion.chunks():
                pass
        assert lender.own_token_gap.observed_at == trio.current_time() and 0 < lender.own_token_gap.mean < 1


async def test_a_lender_closed_for_its_pace_lends_again_when_that_evidence_goes_stale(autojump_clock: trio.testing.MockClock) -> None:
    """Its own streams were slow a token (over 0.4 x the itl promise): nothing is lent until that evidence is old
    (``RecentMean.STALE_AFTER``), and then at once, with no seat freed to trigger it."""
    async with router_over_engines(promised(LendConfig(to=("batch",)))) as fleet:
        await run_to_end(fleet.router, chat("quick?", max_tokens=8, request_id="warm"))  # own traffic lately
        lender = fleet.router.endpoint(INTERACTIVE_URL)
        lender.own_token_gap.observe(1.0, trio.current_time())  # a second a token: far over 0.4 x 0.05 s
        stale_at = lender.own_token_gap.stale_at
        seated: dict[str, tuple[str, float]] = {}
        ended: dict[str, float] = {}

        async def streamed(request_id: str, max_tokens: int) -> None:
            async with fleet.router.open(chat(SHORT_PROMPT, max_tokens=max_tokens, stream=True, request_id=request_id)) as completion:
                seated[request_id] = (completion.routing.endpoint, trio.current_time())
                async for _ in completion.chunks():
                    pass
            ended[request_id] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(streamed, "own", 10 * LONG_OUTPUT)  # batch's one seat, for longer than the evidence lasts
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(streamed, "next", LONG_OUTPUT)  # a batch request too
            await trio.testing.wait_all_tasks_blocked()
            assert "next" not in seated  # the lender is closed for its pace, batch's seat is taken
        endpoint, at = seated["next"]
        assert endpoint == INTERACTIVE_URL and abs(at - stale_at) < 0.01 and ended["own"] > at
