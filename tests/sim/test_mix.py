"""The shared mix's unique bodies: one nonce per request, no shared prefix block, token counts unchanged."""

from __future__ import annotations

import pytest

from tailguard.server.advise.replay.mix import body_for, payloads, prompt_tokens, unique_body_for, unique_payload
from tailguard.sim.prefix_cache import block_hashes
from tailguard.sim.tokens import prompt_token_ids


def _first_block(body: dict[str, object]) -> bytes:
    messages = body["messages"]
    assert isinstance(messages, list)
    text = "".join(m["content"] for m in messages)
    return block_hashes(prompt_token_ids(text, prompt_tokens(body)))[0]


@pytest.mark.parametrize("kind", ["short", "long"])
def test_unique_payload_keeps_the_count_and_shares_no_block(kind: str) -> None:
    bodies = [unique_payload(kind, n) for n in range(200)]
    assert {prompt_tokens(b) for b in bodies} == {prompt_tokens(payloads()[kind])}
    assert len({_first_block(b) for b in bodies}) == 200
    assert all(b["ignore_eos"] is True and b["max_tokens"] == payloads()[kind]["max_tokens"] for b in bodies)


def test_unique_payload_is_deterministic_and_seeded() -> None:
    assert unique_payload("long", 7) == unique_payload("long", 7)
    assert _first_block(unique_payload("long", 7, seed=1)) != _first_block(unique_payload("long", 7, seed=2))
    # the rest of the document is the shared mix's, only the nonce line differs
    text = unique_payload("long", 7)["messages"][0]["content"]  # type: ignore[index]
    assert text[12:] == payloads()["long"]["messages"][0]["content"][12:]  # type: ignore[index]


def test_unique_body_for_a_shape() -> None:
    a, b = unique_body_for(300, 128, 1), unique_body_for(300, 128, 2)
    assert prompt_tokens(a) == prompt_tokens(b) == prompt_tokens(body_for(300, 128)) == 300
    assert _first_block(a) != _first_block(b)
