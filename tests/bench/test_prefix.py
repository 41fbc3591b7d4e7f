"""bench/prefix's pure parts: workloads that share only what they mean to, Mooncake text from hash_ids, the report's maths."""

from __future__ import annotations

import math

import pytest

from bench.harness.mooncake import TraceRow, read_rows
from bench.harness.open_loop import Sample
from bench.prefix.drive import TextClient, with_header
from bench.prefix.engines import EngineCounters, kv_sizing, parse_counters, placements
from bench.prefix.model import MAX_MODEL_LEN, Request
from bench.prefix.mooncake import BLOCK_TOKENS, MAX_PROMPT_TOKENS, SAMPLE, SCALE, block_text, prompt_of, replay, reusable_share
from bench.prefix.report import Measured, Result, hit_rate, latencies, load_spread, summarise, targets
from bench.prefix.setups import CACHE_AWARE, HAND, LEAST_LOADED, TAILGUARD, pool_config
from bench.prefix.text import piece, unique
from bench.prefix.workloads import Spec, conversations, fleet_capacity, rag, tenants, unique_prompts
from tailguard.router.config import parse_config
from tailguard.sim.prefix_cache import prompt_block_keys
from tailguard.sim.tokens import count_text_tokens

SPEC = Spec(seed=3, load=0.8, warmup_s=1.0, seconds=3.0, kv_cache_tokens=23_872)


def blocks(messages: tuple[tuple[str, str], ...]) -> list[bytes]:
    """The simulator's cache keys of a chat prompt's full blocks (its prompt key is the contents joined by NUL)."""
    request = Request(0.0, "short", messages, 1, "")
    return prompt_block_keys("\x00".join(c for _, c in messages), request.prompt_tokens)


def shared_blocks(a: list[bytes], b: list[bytes]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def test_text_pieces_are_exact_deterministic_and_named() -> None:
    assert count_text_tokens(piece("a", 100)) == 100 and len(piece("a", 100)) == 400
    assert piece("a", 100) == piece("a", 100) != piece("b", 100)
    firsts = {unique(n, 40, seed=1)[:64] for n in range(500)}
    assert len(firsts) == 500  # no two numbers share a first 16-token block
    assert all(count_text_tokens(unique(n, 40, seed=1)) == 40 for n in range(20))
    assert unique(7, 40, seed=1) != unique(7, 40, seed=2)


def test_tenants_share_the_system_prompt_and_nothing_else() -> None:
    workload = tenants(SPEC)
    assert workload == tenants(SPEC)  # deterministic
    assert workload.rate_req_s == pytest.approx(0.8 * workload.capacity_req_s)
    assert 0 < workload.requests[0].at and workload.requests[-1].at < SPEC.length_s
    short = [r for r in workload.requests if r.kind == "short"]
    long = [r for r in workload.requests if r.kind == "long"]
    assert short and long and all(r.max_tokens == 64 for r in short)
    by_tenant: dict[str, set[str]] = {}
    for r in short:
        by_tenant.setdefault(r.key, set()).add(r.messages[0][1])
    assert all(len(prompts) == 1 for prompts in by_tenant.values())  # one system prompt a tenant
    assert len({r.messages[-1][1] for r in workload.requests}) == len(workload.requests)  # every question unique
    b = short[0]
    other = next(r for r in short[1:] if r.key == b.key)
    system_blocks = len(b.messages[0][1]) // 4 // 16
    assert shared_blocks(blocks(other.messages), blocks(b.messages)) == system_blocks  # exactly the system prompt is shared
    stranger = next(r for r in short if r.key != b.key)
    assert shared_blocks(blocks(stranger.messages), blocks(b.messages)) == 0
    assert all(r.prompt_tokens + r.max_tokens <= MAX_MODEL_LEN for r in workload.requests)


def test_capacity_counts_the_seats_the_kv_cache_holds() -> None:
    shapes = [(1500, 64), (2000, 64)]
    assert fleet_capacity(shapes, 1 << 26) > fleet_capacity(shapes, 23_872) > fleet_capacity(shapes, 8192)


def test_unique_prompts_share_no_block() -> None:
    workload = unique_prompts(SPEC)
    firsts = [blocks(r.messages)[0] for r in workload.requests]
    assert len(set(firsts)) == len(firsts)


def test_rag_shares_each_document_among_its_questions() -> None:
    workload = rag(SPEC)
    first = workload.requests[0]
    same = next(r for r in workload.requests[1:] if r.key == first.key)
    other = next(r for r in workload.requests[1:] if r.key != first.key)
    shared = shared_blocks(blocks(first.messages), blocks(same.messages))
    assert shared >= 1024 // 16  # at least the shortest document's blocks
    assert shared_blocks(blocks(first.messages), blocks(other.messages)) == 2  # only the common 32-token system prompt
    assert first.messages[1][1] != same.messages[1][1]


def test_conversations_have_unique_turns_and_think_times() -> None:
    workload = conversations(SPEC)
    assert workload == conversations(SPEC) and workload.conversations and not workload.requests
    turns = [t for c in workload.conversations for t in c.turns]
    assert len({t.user for t in turns}) == len(turns)
    assert all(3 <= len(c.turns) <= 8 and c.turns[0].think == 0 for c in workload.conversations)
    assert all(t.think >= 0 for t in turns) and any(t.think > 0 for t in turns)
    assert len({c.key for c in workload.conversations}) == len(workload.conversations)
    assert all(c.at < SPEC.length_s for c in workload.conversations)


def test_mooncake_text_is_built_block_by_block_from_hash_ids() -> None:
    assert block_text(5) == block_text(5) != block_text(6) and len(block_text(5)) == 4 * BLOCK_TOKENS
    a = TraceRow(0, 3 * 512, 10, (0, 1, 2))
    b = TraceRow(0, 3 * 512 - 100, 10, (0, 1, 9))
    ta, tb = prompt_of(a)[0], prompt_of(b)[0]
    assert ta[: 8 * BLOCK_TOKENS] == tb[: 8 * BLOCK_TOKENS]  # ids 0 and 1: the same two blocks of text
    assert ta[8 * BLOCK_TOKENS : 9 * BLOCK_TOKENS] != tb[8 * BLOCK_TOKENS : 9 * BLOCK_TOKENS]
    assert len(ta) == 4 * 3 * 512 // SCALE and len(tb) == 4 * math.ceil((3 * 512 - 100) / SCALE)  # lengths / SCALE
    huge = TraceRow(0, 120_000, 10, tuple(range(235)))
    text, clipped = prompt_of(huge)
    assert clipped and len(text) == 4 * MAX_PROMPT_TOKENS


def test_mooncake_replay_runs_at_the_load_asked() -> None:
    rows = read_rows(SAMPLE)
    assert len(rows) == 400 and rows[0].hash_ids[0] == 0
    workload = replay(SPEC, rows)
    span = workload.requests[-1].at - workload.requests[0].at
    assert (len(rows) - 1) / span == pytest.approx(workload.rate_req_s)
    assert workload.rate_req_s == pytest.approx(0.8 * workload.capacity_req_s)
    keys = [r.key for r in workload.requests]
    assert len(set(keys)) < len(keys)  # the trace's conversations share a pin key
    assert reusable_share([TraceRow(0, 1, 1, (0, 1)), TraceRow(0, 1, 1, (0, 1, 2)), TraceRow(0, 1, 1, (0, 3))]) == 3 / 7


def test_counters_parse_and_sizing() -> None:
    page = (
        'vllm:prefix_cache_queries_total{model_name="m"} 1000.0\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 250.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="m"} 7.0\n'
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
        'vllm:num_preemptions_total{model_name="m"} 2.0\n'
    )
    counters = parse_counters(page)
    assert (counters.requests, counters.queries, counters.hits, counters.preemptions) == (10, 1000, 250, 2)
    assert hit_rate({1: counters, 2: EngineCounters(queries=1000, hits=750)}) == 0.5
    decided = placements('tailguard_placements_total{pool="all",endpoint="a",decision="home"} 5\n'
                         'tailguard_placements_total{pool="all",endpoint="b",decision="home"} 2\n'
                         'tailguard_placements_total{pool="all",endpoint="b",decision="spilled"} 1\n')  # fmt: skip
    assert decided == {"home": 7, "spilled": 1}
    sizing = kv_sizing(36_000, 0.0)
    assert sizing.kv_cache_tokens % 16 == 0 and sizing.kv_cache_tokens >= 12_000 + 32 * 112


def test_tailguard_config_is_valid() -> None:
    for placement in ("least_loaded", None):
        config = parse_config(pool_config(18080, 18081, [18001, 18002, 18003, 18004], 3.0, placement))
        assert len(config.pools) == 1


def _sample(kind: str, ttft: float | None, e2e: float | None, outcome: str = "ok", measured: bool = True) -> Sample:
    return Sample(kind, measured, 0.0, outcome=outcome, ttft=ttft, e2e=e2e)


def test_latencies_count_a_cut_request_as_slowest_and_leave_errors_out() -> None:
    samples = [_sample("short", 0.3, 0.6), _sample("short", 0.6, None, "cut"), _sample("short", None, 0.01, "503"),
               _sample("short", 3.0, 6.0, measured=False), _sample("long", 0.3, 0.3)]  # fmt: skip
    ttft, e2e = latencies(samples, "short", scale=3.0)
    assert ttft == [pytest.approx(100.0), pytest.approx(200.0)] and e2e == [pytest.approx(200.0), math.inf]


def test_load_spread() -> None:
    assert load_spread([10, 10, 10, 10]) == 1.0
    assert load_spread([0, 0, 40, 0]) == 4.0
    assert math.isnan(load_spread([0, 0]))


def _run(workload: str, setup: str, p50: float, p99: float, e2e: float, spread: float = 1.0) -> object:
    samples = [_sample("short", p50 / 1000, e2e / 1000)] * 98 + [_sample("short", p99 / 1000, e2e / 1000)] * 2
    ends = {1: EngineCounters(requests=spread), 2: EngineCounters(requests=2 - spread)}
    return summarise(workload, setup, "", Measured(samples, [], {}, ends), 1.0, 500, {})


def test_targets_compare_tailguard_with_its_peers() -> None:
    result = Result([], "", 1.0, "", "", "", "", 0.8)
    result.runs = [
        _run("tenants", TAILGUARD, 30, 300, 900, spread=1.2),  # type: ignore[list-item]
        _run("tenants", HAND, 25, 400, 1000),  # type: ignore[list-item]
        _run("tenants", CACHE_AWARE, 20, 600, 1200),  # type: ignore[list-item]
        _run("multi-turn", TAILGUARD, 10, 60, 100),  # type: ignore[list-item]
        _run("multi-turn", LEAST_LOADED, 10, 100, 100),  # type: ignore[list-item]
    ]
    verdicts = {t.name + " " + t.goal: t.met for t in targets(result)}
    assert verdicts == {
        "tenants: short TTFT P50 <= 1.5x hand affinity": True,  # 1.2x
        "tenants: short TTFT P99 <= 1x hand affinity": True,
        "tenants: short E2E P99 <= 1x hand affinity": True,
        "tenants: short TTFT P50 <= 1x cache_aware": False,  # 1.5x
        "tenants: short TTFT P99 <= 1x cache_aware": True,
        "tenants: short E2E P99 <= 1x cache_aware": True,
        "tenants: engine load max/mean <= 1.3": True,  # 1.2
        "multi-turn: short TTFT P99 <= 0.5x least loaded": False,  # 0.6x
    }


def test_text_client_reads_the_streamed_answer() -> None:
    client = TextClient(1)
    client.parts = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\ndata: {"choices":[{"index":0,"delta":{"content":" the"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" of"}}]}\n\ndata: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n',
    ]
    assert client.answer() == " the of"
    request = with_header(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n{}", "X-Session-ID", "tenant-3")
    assert request == b"POST / HTTP/1.1\r\nX-Session-ID: tenant-3\r\nHost: x\r\n\r\n{}"
