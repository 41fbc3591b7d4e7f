"""cache_salt = "caller": each caller's prefixes cached apart, on the wire against simulated engines that honour vLLM's cache_salt."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from tailguard.router.admission import caller_salt
from tailguard.router.config import ApiKeyConfig, AuthConfig, CacheSaltMode, Config, PlacementConfig
from tailguard.router.quotas import hash_key
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, tailguard

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"
DOCUMENT = "Clause {n}: the supplier shall deliver the goods in good order. "
MESSAGES = [{"role": "user", "content": "".join(DOCUMENT.format(n=n) for n in range(12)) + "Summarise."}]  # ~190 tokens


def config_for(urls: list[str], salt: CacheSaltMode) -> Config:
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]])
    interactive, batch = config.pools
    interactive = dataclasses.replace(interactive, placement=PlacementConfig(cache_salt=salt))
    keys = AuthConfig(keys=(ApiKeyConfig("alice", hash_key(ALICE)), ApiKeyConfig("bob", hash_key(BOB))))
    return dataclasses.replace(config, pools=(interactive, batch), auth=keys)


async def cached(client: httpx.AsyncClient, key: str, **extra: Any) -> int:
    """The prompt tokens the engine found cached for one chat request of ``key``'s caller."""
    response = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra}, headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


@pytest.mark.parametrize("salt", ["caller", "none"])
async def test_callers_share_cached_prefixes_only_without_a_salt(salt: CacheSaltMode) -> None:
    async with engines_on_sockets([QUICK, QUICK], prompt_tokens_details=True) as backends, tailguard(config_for(backends.urls, salt)) as running:
        async with httpx.AsyncClient(base_url=running.http_url) as client:
            assert await cached(client, ALICE) == 0  # cold
            assert await cached(client, ALICE) > 0  # her own prefix, cached
            bob = await cached(client, BOB)
            # Bob naming Alice's salt gets his own mix of it, never hers.
            bob_posing = await cached(client, BOB, cache_salt=caller_salt("alice"))
    if salt == "caller":
        assert bob == 0 and bob_posing == 0
    else:
        assert bob > 0  # one cache for everyone: Bob's first request hits Alice's blocks
        assert bob_posing == 0  # (a salt the caller sent goes on as sent: a new one misses)


def test_the_salt_is_the_callers_and_mixes_what_it_sent() -> None:
    assert caller_salt("alice") == caller_salt("alice") != caller_salt("bob")
    assert len(caller_salt("alice")) == 64 and int(caller_salt("alice"), 16) >= 0
    assert caller_salt("alice", "team-a") not in {caller_salt("alice"), caller_salt("bob", "team-a"), "team-a"}
    assert caller_salt("alice", 7) != caller_salt("alice", "7")  # a non-string is mixed as JSON, never dropped
