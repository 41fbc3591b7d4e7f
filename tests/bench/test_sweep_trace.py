"""The Mooncake replay's prompts: built from hash_ids, so equal ids give equal text and shared cache blocks."""

from __future__ import annotations

from bench.trace.mooncake import TRACE_BLOCK_TOKENS, prompt_text
from tailguard.server.advise.replay.fleet import prompt_of
from tailguard.sim.prefix_cache import BLOCK_SIZE, prompt_block_keys
from tailguard.sim.tokens import count_chat_tokens


def _keys(text: str) -> list[bytes]:
    return prompt_block_keys(text, count_chat_tokens([text]))


def test_a_prompt_has_its_length_and_equal_ids_share_exactly_their_blocks() -> None:
    first = prompt_text([0, 1, 2, 3], 1800)
    second = prompt_text([0, 1, 9], 1500)
    assert count_chat_tokens([first]) == 1800 and count_chat_tokens([second]) == 1500
    a, b = _keys(first), _keys(second)
    shared = 2 * TRACE_BLOCK_TOKENS // BLOCK_SIZE  # ids 0 and 1: 64 of the simulator's blocks
    assert a[:shared] == b[:shared] and a[shared] != b[shared]
    assert prompt_text([5, 6], 900) == prompt_text([5, 6], 900)


def test_the_fleet_keys_a_body_by_its_text_and_cache_salt() -> None:
    body = {"messages": [{"role": "user", "content": prompt_text([0, 1], 1000)}], "max_tokens": 8}
    tokens, keys = prompt_of(body)
    _, salted = prompt_of({**body, "cache_salt": "tenant-b"})
    assert tokens == 1000 and keys == _keys(prompt_text([0, 1], 1000))
    assert salted[0] != keys[0]
    assert prompt_of(body, keys=False) == (1000, [])
