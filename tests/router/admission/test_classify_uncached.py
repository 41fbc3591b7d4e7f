"""Classification by the tokens that need prefill: a warm conversation stays interactive, anything unknown counts every token."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import trio
import trio.testing

from tailguard.router.admission import RouterRequest
from tailguard.router.config import Config, PlacementConfig, PromptBound
from tests.helpers.router import Fleet, router_over_engines, run_to_end, two_pool_config

INTERACTIVE_URLS = ("http://interactive-0:8000", "http://interactive-1:8000")
# ~1,800 characters: ~450 estimated tokens, under the interactive class's 500; a second turn passes 500.
SYSTEM = "You answer questions about the tailguard router, briefly and exactly. " * 26


def config(prompt_bound: PromptBound, *, placement: PlacementConfig | None = None) -> Config:
    made = two_pool_config(interactive_urls=INTERACTIVE_URLS)
    classes = tuple(dataclasses.replace(c, prompt_bound=prompt_bound) if c.name == "interactive" else c for c in made.classes)
    pools = tuple(dataclasses.replace(p, placement=placement) if placement is not None and p.name == "interactive" else p for p in made.pools)
    return dataclasses.replace(made, classes=classes, pools=pools)


def turn(messages: list[dict[str, Any]], number: int) -> RouterRequest:
    return RouterRequest(kind="chat", request_id=f"turn-{number}", messages=messages, max_tokens=16)


class Conversation:
    """A chat that resends its history and each answer received."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        self.turns = 0

    async def next_turn(self, fleet: Fleet) -> tuple[str, str, int]:
        """One more question: the turn's (class, endpoint, estimated prompt tokens)."""
        self.messages.append({"role": "user", "content": f"Question {self.turns}: what does the wait queue do when a deadline passes?"})
        body, routing = await run_to_end(fleet.router, turn(list(self.messages), self.turns))
        self.turns += 1
        self.messages.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})
        return routing.request_class, routing.endpoint, routing.prompt_tokens


async def converse(fleet: Fleet, turns: int) -> list[tuple[str, str, int]]:
    conversation = Conversation()
    return [await conversation.next_turn(fleet) for _ in range(turns)]


async def test_a_warm_conversation_over_the_raw_bound_stays_interactive_on_its_home(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config("uncached")) as fleet:
        seen = await converse(fleet, 4)
    classes = [klass for klass, _, _ in seen]
    assert [tokens > 500 for _, _, tokens in seen] == [False, True, True, True]  # by raw length turns 2-4 are batch
    assert classes == ["interactive"] * 4
    assert len({endpoint for _, endpoint, _ in seen}) == 1  # every turn on the engine that holds its history


async def test_counting_every_token_sends_the_same_turns_to_batch(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config("all")) as fleet:
        seen = await converse(fleet, 3)
    assert [klass for klass, _, _ in seen] == ["interactive", "batch", "batch"]


async def test_a_home_that_went_down_counts_every_token(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config("uncached")) as fleet:
        conversation = Conversation()
        first = [await conversation.next_turn(fleet) for _ in range(2)]
        assert [klass for klass, _, _ in first] == ["interactive", "interactive"]
        for endpoint in fleet.router.pool("interactive").endpoints:
            if endpoint.url == first[1][1]:
                endpoint.healthy = False  # the engine holding its history leaves
        klass, _, tokens = await conversation.next_turn(fleet)
    assert tokens > 500
    assert klass == "batch"


async def test_a_pool_placing_by_load_alone_counts_every_token(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config("uncached", placement=PlacementConfig(mode="least_loaded"))) as fleet:
        seen = await converse(fleet, 2)
    assert [klass for klass, _, _ in seen] == ["interactive", "batch"]
