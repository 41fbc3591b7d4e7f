"""The chaos benchmark's pure parts: the figures its issue-32 rows compute, and the configs its phases run tailguard on."""

from __future__ import annotations

import json

import pytest

from bench.chaos.abuse import SHIPPED_GATE, costly_bodies
from bench.chaos.client import Reply
from bench.chaos.figures import p50_p99_max_ms, queue_seconds, refusal_spells, retry_after, usage_tokens
from bench.chaos.lab import ENGINE_KEY, ENGINE_KEY_ENV, NORMAL_KEY, SHIPPED_GRPC_GATE, Key, Setup, tailguard_config
from bench.chaos.tenants import BUDGETS, TENANTS_CLUSTER, tenant_keys
from tailguard.router.config import parse_config
from tailguard.router.quotas import hash_key

ENGINES = {"a": 18001, "b": 18002, "c": 18003}
REDIS = "redis://127.0.0.1:6390/0"


def test_usage_of_a_whole_answer_and_of_a_streams_usage_event() -> None:
    whole = Reply(status=200, body=json.dumps({"choices": [], "usage": {"total_tokens": 812}}).encode())
    stream = Reply(status=200, body=b'data: {"choices": [{"delta": {}}]}\n\ndata: {"choices": [], "usage": {"total_tokens": 44}}\n\ndata: [DONE]\n\n')
    assert usage_tokens(whole, False) == 812 and usage_tokens(stream, True) == 44
    assert usage_tokens(Reply(status=429, body=whole.body), False) == 0
    assert usage_tokens(Reply(status=200, body=b"data: [DONE]\n\n"), True) == 0


def test_refusal_spells_run_from_the_first_refusal_to_the_next_success() -> None:
    requests = [(5.0, False, None), (1.0, True, 2.0), (2.0, True, 1.0), (4.0, False, None), (6.0, True, 30.0)]
    spells = refusal_spells(requests)
    assert [(s.start, s.hint_s, s.lasted_s) for s in spells] == [(1.0, 2.0, 3.0), (6.0, 30.0, None)]
    assert refusal_spells([(0.0, False, None)]) == []


def test_headers_read_for_hints_and_queue_time() -> None:
    assert retry_after(Reply(headers={"retry-after": "2.5"})) == 2.5
    assert retry_after(Reply(headers={"retry-after": "soon"})) is None and retry_after(Reply()) is None
    assert queue_seconds(Reply(headers={"server-timing": "queue;dur=250.0, ttft;dur=12.5"})) == 0.25
    assert queue_seconds(Reply(headers={"server-timing": "ttft;dur=1"})) == 0.0
    assert p50_p99_max_ms([0.1, 0.2, 0.3])[2] == 300.0 and p50_p99_max_ms([]) == []


def test_costly_bodies_are_under_the_shipped_body_limit_and_hold_their_100000_pieces() -> None:
    parts, messages = costly_bodies()
    assert max(len(parts), len(messages)) < 4 * 1024 * 1024  # server.max_body_bytes as shipped: they get parsed
    assert len(json.loads(parts)["messages"][0]["content"]) == len(json.loads(messages)["messages"]) == 100_000


@pytest.mark.parametrize(
    "setup",
    [Setup(), Setup(shipped_timeouts=True), Setup(interactive_pool=False), SHIPPED_GATE, TENANTS_CLUSTER, BUDGETS],
    ids=["lab", "shipped timeouts", "pool removed", "shipped gate", "tenants cluster", "budgets"],
)
def test_each_phase_config_is_one_tailguard_accepts(setup: Setup) -> None:
    config = parse_config(tailguard_config(8080, 50051, ENGINES, setup, REDIS), environ={ENGINE_KEY_ENV: ENGINE_KEY})
    pools = {pool.name: pool for pool in config.pools}
    assert all(endpoint.access.api_key_env == ENGINE_KEY_ENV for pool in pools.values() for endpoint in pool.endpoints)
    classes = {klass.name: klass.pool for klass in config.classes}
    assert ("interactive" in pools) == setup.interactive_pool and classes["interactive"] in pools
    assert (config.cluster is not None) == (setup.cluster is not None)
    assert config.timeouts.end_to_end_timeout == (120.0 if setup.shipped_timeouts else 8.0)
    assert sum(p.max_concurrency + p.max_queue for p in pools.values()) == setup.room
    if setup.keys:
        digests = {key.sha256 for key in config.auth.keys}
        assert {hash_key(k.secret) for k in (NORMAL_KEY, *setup.keys)} == digests


def test_the_shipped_gate_setup_lets_the_gate_be_the_shipped_one() -> None:
    assert 2 * SHIPPED_GATE.room + 64 >= SHIPPED_GRPC_GATE  # the gate's bound from the room (docs/grpc.md) does not bind
    assert 2 * Setup().room + 64 < SHIPPED_GRPC_GATE  # as it would with the lab's own pools


def test_tenant_key_sets_do_not_share_a_key_and_carry_budgets() -> None:
    first, second = tenant_keys(0, 3), tenant_keys(1, 3)
    assert not {k.secret for k in first} & {k.secret for k in second}
    assert all(isinstance(k, Key) and k.tokens_per_minute for k in first)
