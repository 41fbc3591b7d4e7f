"""The simulated engine's model of vLLM's ``--scheduling-policy priority``, in virtual time.

What is asserted is what vLLM V1's scheduler does (docs/vllm-priority.md):
the queue runs lowest (priority, arrival) first; a decode that finds the KV
cache full preempts the running sequence of the largest (priority, arrival);
a waiting sequence never preempts a running one, so a full batch makes even a
priority-0 arrival wait for the next free seat. Under fcfs the priority field
is accepted and ignored, and the newest running sequence is the one preempted.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from tailguard.sim import Engine, EngineParams, Sequence
from tailguard.sim.__main__ import build_parser
from tailguard.sim.app import SimApp

# Round numbers: a step is 10 ms + 1 ms a sequence, prefill and attention free.
ROUND = EngineParams(
    max_num_seqs=4,
    max_num_batched_tokens=1000,
    max_model_len=1000,
    kv_cache_tokens=100_000,
    base_ms=10.0,
    per_seq_ms=1.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=0.0,
)
PRIORITY = ROUND.replace(scheduling_policy="priority")


async def start(nursery: trio.Nursery, params: EngineParams) -> Engine:
    engine = Engine(params)
    await nursery.start(engine.run)
    return engine


async def token_times(sequence: Sequence) -> list[float]:
    """The time each token of ``sequence`` appeared, as a reader sees it."""
    times: list[float] = []
    while not sequence.finished:
        await sequence.wait_for_tokens(len(times))
        times.extend([trio.current_time()] * (len(sequence.token_ids) - len(times)))
    return times


def first_token(sequence: Sequence) -> float:
    assert sequence.first_token_at is not None
    return sequence.first_token_at


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_a_full_batch_makes_a_priority_0_arrival_wait_for_the_next_seat(
    policy: str, autojump_clock: trio.testing.MockClock
) -> None:
    """vLLM V1 preempts for KV cache only: at max_num_seqs the waiter waits, then goes first."""
    params = ROUND.replace(scheduling_policy=policy)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        batch = [engine.submit(10, 10 * (i + 1), priority=1, prompt_key=str(i)) for i in range(4)]
        await trio.sleep(0.05)  # the batch decodes
        early = [engine.submit(10, 5, priority=1, prompt_key=f"early{i}") for i in range(2)]
        urgent = engine.submit(10, 5, priority=0, prompt_key="urgent")
        await trio.sleep(0.05)
        stats = engine.statistics()
        assert (stats.running, stats.waiting, stats.preemptions) == (4, 3, 0)
        for sequence in [*batch, *early, urgent]:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    assert engine.statistics().preemptions == 0
    assert all(s.preemptions == 0 for s in [*batch, *early, urgent])
    freed = batch[0].finished_at
    assert freed is not None
    if policy == "priority":
        # The first seat that frees is the urgent one's: the next step
        # (three decodes and its free prefill, 10 + 4 ms) gives its first token.
        assert first_token(urgent) == pytest.approx(freed + 0.014)
        assert first_token(urgent) < min(map(first_token, early))
    else:
        assert first_token(early[0]) == pytest.approx(freed + 0.014)
        assert first_token(urgent) > max(map(first_token, early))


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_a_full_kv_cache_preempts_the_lowest_priority_not_the_newest(
    policy: str, autojump_clock: trio.testing.MockClock
) -> None:
    params = ROUND.replace(scheduling_policy=policy, max_num_seqs=8, kv_cache_tokens=1200)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        background = [engine.submit(200, 600, priority=1, prompt_key=str(i)) for i in range(3)]
        await trio.sleep(0.03)
        urgent = engine.submit(200, 600, priority=0, prompt_key="urgent")  # the newest
        times = await token_times(urgent)
        for sequence in background:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    stats = engine.statistics()
    assert stats.preemptions > 0  # 4 x 800 tokens cannot share 1,200
    assert stats.max_kv_used_seen <= 1200
    assert all(len(s.token_ids) == 600 for s in [*background, urgent])
    gaps = [b - a for a, b in zip(times, times[1:])]
    if policy == "priority":
        # Each time the cache runs short, a priority-1 sequence (the latest
        # of them) leaves the batch in that step: the urgent one never stalls.
        assert urgent.preemptions == 0
        assert background[2].preemptions > 0
        assert max(gaps) <= (10 + 4) / 1000 + 1e-9
    else:
        # fcfs preempts the newest running sequence, whatever its priority.
        assert urgent.preemptions > 0
        assert max(gaps) > 0.1


@pytest.mark.parametrize(
    ("policy", "order"),
    [("priority", ["e", "b", "d", "a"]), ("fcfs", ["a", "b", "d", "e"])],
)
async def test_waiters_run_by_priority_then_arrival(
    policy: str, order: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    params = ROUND.replace(scheduling_policy=policy, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        seated = engine.submit(10, 5, priority=9)
        await trio.sleep(0.02)
        waiters = {
            name: engine.submit(10, 3, priority=priority, prompt_key=name)
            for name, priority in [("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]
        }
        engine.abort(waiters["c"])  # an aborted waiter leaves the queue at once
        assert engine.statistics().waiting == 4
        for sequence in [seated, *waiters.values()]:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    assert waiters["c"].finish_reason == "abort" and not waiters["c"].token_ids
    ran = sorted((name for name in waiters if name != "c"), key=lambda name: first_token(waiters[name]))
    assert ran == order
    assert engine.statistics().preemptions == 0


async def test_the_priority_field_is_validated_and_reaches_the_engine(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[int] = []
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, PRIORITY)
        engine.add_finish_hook(lambda sequence: seen.append(sequence.priority))
        app = SimApp(engine, model="m")

        async def complete(**extra: object) -> tuple[int, dict[str, object]]:
            body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2, **extra}).encode()
            response = await app.handle("POST", "/v1/completions", {"content-type": "application/json"}, body)
            return response.status, json.loads(response.body)

        for bad in ["high", 1.5, [0], 2**63, None]:  # pydantic's int64 field; null is no int (the field is not optional)
            status, body = await complete(priority=bad)
            assert status == 400, bad
            error = body["error"]
            assert isinstance(error, dict) and error["param"] == "body.priority" and error["type"] == "Bad Request"
        assert engine.statistics().finished_total == 0  # nothing refused reached the engine
        for good in [-3, True, "7"]:  # pydantic's lax int: a bool and a numeric string are ints
            status, _ = await complete(priority=good)
            assert status == 200
        nursery.cancel_scope.cancel()
    assert seen == [-3, 1, 7]


async def test_fcfs_accepts_a_priority_and_ignores_it(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM V1 under fcfs takes the field and orders by arrival (v0 and early v1 refused it)."""
    statuses: list[int] = []
    finished: list[int] = []  # each sequence's priority, in the order they finish
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, ROUND.replace(max_num_seqs=1))
        engine.add_finish_hook(lambda sequence: finished.append(sequence.priority))
        app = SimApp(engine, model="m")

        async def complete(priority: int) -> None:
            body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "priority": priority}).encode()
            response = await app.handle("POST", "/v1/completions", {"content-type": "application/json"}, body)
            statuses.append(response.status)

        engine.submit(10, 5, priority=9)
        await trio.sleep(0.001)  # it holds the one seat now: both calls wait for it
        async with trio.open_nursery() as calls:
            calls.start_soon(complete, 5)
            await trio.sleep(0.001)
            calls.start_soon(complete, 0)  # arrives later with the better priority
        nursery.cancel_scope.cancel()
    assert statuses == [200, 200]
    assert finished == [9, 5, 0]  # by arrival; the priority policy would run the 0 before the 5


def test_the_policy_is_a_parameter_and_a_flag() -> None:
    assert ROUND.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy"):
        ROUND.replace(scheduling_policy="lifo")
    assert build_parser().parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    assert build_parser().parse_args([]).scheduling_policy is None  # the profile's own: fcfs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--scheduling-policy", "lifo"])
