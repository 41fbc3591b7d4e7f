"""The conversation memory behind ``prompt_bound = "uncached"``: which engine holds a history warm."""

from __future__ import annotations

from typing import Any

import pytest

from tailguard.router.admission import ConversationMemory, HistoryDigests, Warm, history_digests, uncached_tokens


def chat(*texts: str) -> list[dict[str, Any]]:
    """A conversation: a system prompt, then user and assistant turns alternating."""
    roles = ["system"] + ["user", "assistant"] * len(texts)
    return [{"role": role, "content": text} for role, text in zip(roles, texts, strict=False)]


def digests(messages: list[dict[str, Any]]) -> HistoryDigests:
    found = history_digests(messages)
    assert found is not None
    return found


def test_the_next_turn_finds_the_turn_before_it() -> None:
    memory = ConversationMemory()
    first = chat("be brief", "what is a KV cache?")
    memory.remember(digests(first).whole, "http://e1", 900)
    second = [*first, {"role": "assistant", "content": "It holds keys."}, {"role": "user", "content": "and a block?"}]
    assert memory.warm(digests(second)) == Warm("http://e1", 900)


def test_a_different_history_finds_nothing() -> None:
    memory = ConversationMemory()
    memory.remember(digests(chat("be brief", "what is a KV cache?")).whole, "http://e1", 900)
    other = chat("be brief", "what is a page table?", "It maps pages.", "and a TLB?")
    assert memory.warm(digests(other)) is None


def test_the_turn_just_before_is_found_not_an_older_one() -> None:
    memory = ConversationMemory()
    turns = chat("sys", "q1", "a1", "q2", "a2", "q3")
    memory.remember(digests(turns[:2]).whole, "http://e1", 100)  # turn 1 (system + q1)
    memory.remember(digests(turns[:4]).whole, "http://e2", 300)  # turn 2 (+ a1, q2)
    assert memory.warm(digests(turns)) == Warm("http://e2", 300)  # turn 3's history is turn 2's whole list


def test_text_parts_and_roles_count() -> None:
    as_string = [{"role": "user", "content": "hello there"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    as_system = [{"role": "system", "content": "hello there"}]
    assert digests(as_string).whole == digests(as_parts).whole
    assert digests(as_string).whole != digests(as_system).whole


def test_a_completion_or_an_empty_chat_has_no_history() -> None:
    assert history_digests(None) is None
    assert history_digests([]) is None
    assert digests(chat("only a system prompt")).earlier == ()


def test_least_recently_used_is_forgotten_first() -> None:
    memory = ConversationMemory(capacity=2)
    histories = [chat("sys", f"question {n}") for n in range(3)]
    memory.remember(digests(histories[0]).whole, "http://e1", 10)
    memory.remember(digests(histories[1]).whole, "http://e1", 10)
    follow_up = [*histories[0], {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    assert memory.warm(digests(follow_up)) is not None  # used: now the most recent
    memory.remember(digests(histories[2]).whole, "http://e1", 10)
    assert len(memory) == 2
    assert memory.warm(digests(follow_up)) is not None
    gone = [*histories[1], {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    assert memory.warm(digests(gone)) is None


def test_uncached_tokens_counts_all_without_a_warm_home_and_never_below_one() -> None:
    assert uncached_tokens(5000, None) == 5000
    assert uncached_tokens(5000, Warm("http://e1", 4800)) == 200
    assert uncached_tokens(5000, Warm("http://e1", 9000)) == 1


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ConversationMemory(capacity=0)
