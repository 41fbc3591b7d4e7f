"""The benchmarks' unique requests (spliced bytes equal each request's encoded body, no shared block) and the cluster's affinity share."""

from __future__ import annotations

import json
from functools import partial

import pytest

from bench.cluster.affinity import body, share, tenant_prompt
from bench.harness.client import CHAT_PATH, http_request
from bench.harness.config import MODEL
from bench.harness.unique import UniqueRequests, prefixed, run_seed
from bench.tail.measure import forwarded_body
from tailguard.router.admission import key_chars, prefix_key
from tailguard.server.advise.replay.mix import prompt_tokens, unique_body_for, unique_payload
from tailguard.sim.prefix_cache import block_hashes
from tailguard.sim.tokens import prompt_token_ids


def _body(request: bytes) -> dict[str, object]:
    head, _, body = request.partition(b"\r\n\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    parsed = json.loads(body)
    assert isinstance(parsed, dict)
    return parsed


@pytest.mark.parametrize("kind", ["short", "long"])
def test_spliced_requests_are_the_encoded_bodies(kind: str) -> None:
    requests = UniqueRequests(8000, CHAT_PATH, partial(unique_payload, kind, seed=5), seed=5)
    for number in (0, 1, 2, 17, 4095, 10**9):
        assert requests.request(number) == http_request(8000, CHAT_PATH, unique_payload(kind, number, seed=5))


def test_no_two_requests_share_a_prefix_block() -> None:
    requests = UniqueRequests(8000, CHAT_PATH, lambda n: unique_body_for(2000, 512, n, seed=3), seed=3)
    bodies = [_body(r) for r in requests.prebuilt(300)]
    firsts = set()
    for one in bodies:
        text = "".join(str(m["content"]) for m in one["messages"])  # type: ignore[attr-defined]
        firsts.add(block_hashes(prompt_token_ids(text, prompt_tokens(one)))[0])
        assert one["ignore_eos"] is True
    assert len(firsts) == 300


def test_a_body_that_varies_beyond_the_nonce_is_refused() -> None:
    with pytest.raises(ValueError, match="beyond the nonce"):
        UniqueRequests(8000, CHAT_PATH, lambda n: {**unique_payload("short", n), "max_tokens": 8 + n})
    with pytest.raises(ValueError, match="exactly once"):
        UniqueRequests(8000, CHAT_PATH, lambda n: unique_payload("short", n, seed=1), seed=2)  # another seed's nonce


def test_prefixed_keeps_the_text_after_the_nonce() -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 16}
    requests = UniqueRequests(8000, CHAT_PATH, partial(prefixed, body, seed=9), seed=9)
    one, two = _body(requests.request(1)), _body(requests.request(2))
    assert one != two and one["ignore_eos"] is True
    assert str(one["messages"][0]["content"]).endswith("\nhi there")  # type: ignore[index]


def test_run_seeds_are_stable_and_distinct() -> None:
    assert run_seed(1, 0.8, "shared") == run_seed(1, 0.8, "shared")
    assert len({run_seed(1, load, name) for load in (0.8, 1.3) for name in ("shared", "priority")}) == 4


def test_affinity_share_counts_requests_on_their_tenants_engine() -> None:
    sent = {f"r{i}": (i % 2, f"replica{i % 4}") for i in range(8)} | {"r8": (0, "replica3")}  # tenant 0: r0 r2 r4 r6 r8
    served = {"r0": "e1", "r2": "e1", "r4": "e1", "r6": "e1", "r8": "e2", "r1": "e3", "r3": "e3", "r5": "e3", "r7": "e3"}
    found = share(sent, served)
    assert (found["joined"], found["on_tenant_engine"], found["share"]) == (9, 8, 0.8889)
    assert found["replica_tenant_pairs_agreeing"] == "4/5"  # replica3's only tenant-0 request (r8) went elsewhere
    assert found["requests_per_engine"] == {"e1": 4, "e2": 1, "e3": 4}
    assert share(sent, {})["share"] is None  # nothing joined: no verdict, not 0 or 1


def test_affinity_bodies_share_the_prefix_key_and_nothing_after() -> None:
    one, two, other = body(3, 1, seed=0), body(3, 2, seed=0), body(4, 1, seed=0)
    assert prefix_key(one) == prefix_key(two) != prefix_key(other)  # the system prompt covers the key's 1,024 characters
    assert one["messages"][1] != two["messages"][1]  # type: ignore[index]
    assert len(tenant_prompt(3)) >= key_chars()


def test_forwarded_body_is_unique_and_capped() -> None:
    a, b = forwarded_body(2000, 512, 1, seed=4), forwarded_body(2000, 512, 2, seed=4)
    assert a["messages"] != b["messages"] and a["ignore_eos"] is True
    assert a["model"] == MODEL
