"""Checks the sweep leans on: its engine, the shared fleet's capacity, and virtual vs real time.

- The sweep's engine (``tailguard.server.advise.replay.engine``) against ``bench.sim.Engine``:
  the same seeded submissions and hang-ups through both, every first-token
  and finish time compared.
- Capacity: the analytic figure ``quick_mixed.shared_capacity`` computes, and
  a saturation run of one throughput engine in virtual time (offered twice
  its capacity, completions counted over a window) to confirm it.
- Virtual vs real: ``bench/tail/quick_mixed.py``'s exact arrival schedule (same
  seed, rate, warm-up and window) replayed through the same set-ups in
  virtual time, next to its real-time results.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio
import trio.testing

from bench.harness.procs import RESULTS_ROOT
from bench.harness.traffic import schedule
from tailguard.server.advise.replay.clock import Timeline
from tailguard.server.advise.replay.engine import SweepEngine
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.replay.mix import (
    SHORT_SHARE,
    Capacity,
    long_document,
    payloads,
    prompt_tokens,
    shared_capacity,
    unique_payload,
)
from tailguard.server.advise.replay.point import MAX_TOKENS, Point, PointResult
from tailguard.server.advise.replay.setups import Setup, disaggregated, shared, split_direct
from tailguard.sim.engine import Engine
from tailguard.sim.params import PROFILES, EngineParams
from tailguard.sim.prefix_cache import prompt_block_keys
from tailguard.sim.sequence import Sequence as EngineSequence
from tailguard.sim.tokens import chat_prompt_key, count_chat_tokens

QUICK_MIXED_JSON = RESULTS_ROOT / "quick_mixed.json"
COMPARED = (("ttft_p50_ms", "TTFT P50"), ("ttft_p99_ms", "TTFT P99"), ("e2e_p50_ms", "E2E P50"), ("e2e_p99_ms", "E2E P99"))


def mix_prompt_tokens() -> tuple[int, int]:
    """The simulator's prompt sizes of the short and long payloads (20 and 2,021)."""
    bodies = payloads()
    return prompt_tokens(bodies["short"]), prompt_tokens(bodies["long"])


def model_capacity() -> Capacity:
    """One throughput engine's capacity for the mix, from the cost model (as quick_mixed uses)."""
    return shared_capacity(PROFILES["throughput"], *mix_prompt_tokens())


# -- the sweep's engine against bench.sim.Engine ------------------------------------


@dataclass(frozen=True)
class Submission:
    at: float
    kind: str
    hang_up_after: float | None  # seconds after submitting, or never
    prompt_key: str = ""  # the prompt's text as the simulator's API builds it (tokens.chat_prompt_key)
    prompt_tokens: int = 1
    cache_salt: str | None = None

    def block_keys(self) -> list[bytes]:
        """What the sweep's engine is given: the keys ``tailguard.sim.Engine`` computes from the same text."""
        return prompt_block_keys(self.prompt_key, self.prompt_tokens, self.cache_salt)


@dataclass(frozen=True)
class EngineAgreement:
    """One engine profile, the same submissions through bench.sim.Engine and SweepEngine."""

    profile: str
    offered_req_per_s: float
    seconds: float
    requests: int
    hang_ups: int
    preemptions_reference: int
    preemptions_sweep: int
    differing: int  # requests that ended differently (or only in one engine) by the cut-off
    max_difference_s: float  # largest difference of a first-token or finish time
    documents: int = 0  # shared documents in the traffic (0: every prompt unique)
    prefix_hits_reference: int = 0  # prefix-cache hit tokens, preempted re-hits included
    prefix_hits_sweep: int = 0

    @property
    def agrees(self) -> bool:
        return (
            self.differing == 0
            and self.max_difference_s <= 1e-9
            and self.preemptions_reference == self.preemptions_sweep
            and self.prefix_hits_reference == self.prefix_hits_sweep
        )


Timings = list[tuple[float | None, float | None, str | None]]  # first token, finish, reason; per submission


SALTED_SHARE = 0.25  # of shared-prefix traffic, sent with another cache_salt (the same text must miss)


def submissions(rate: float, seconds: float, hang_up_share: float, seed: int, *, documents: int = 0) -> list[Submission]:
    """Poisson submissions of the mix, every prompt unique; a share of them hang up at a random moment.

    With ``documents``, long requests instead ask a unique question about
    one of that many shared documents (the mix's long prompt's size), so
    the prefix cache hits, and a share of them carry another ``cache_salt``.
    """
    rng = random.Random(seed)
    out: list[Submission] = []
    at = rng.expovariate(rate)
    while at < seconds:
        kind = "short" if rng.random() < SHORT_SHARE else "long"
        hang_up = rng.uniform(0.01, 30.0) if rng.random() < hang_up_share else None
        body = unique_payload(kind, len(out), seed=seed)
        salt = None
        if documents and kind == "long":
            document = long_document(seed=rng.randrange(documents))
            body = {**body, "messages": [{"role": "user", "content": f"{document}\n\nQuestion {len(out)}: summarize it."}]}
            salt = "other" if rng.random() < SALTED_SHARE else None
        contents = [m["content"] for m in body["messages"]]  # type: ignore[attr-defined]
        out.append(Submission(at, kind, hang_up, chat_prompt_key(contents), count_chat_tokens(contents), salt))
        at += rng.expovariate(rate)
    return out


async def _submit_all(
    nursery: trio.Nursery, plan: Sequence[Submission], submit: Callable[[Submission], Any], abort: Callable[[Any], None]
) -> list[Any]:
    async def hang_up(sequence: Any, after: float) -> None:
        await trio.sleep(after)
        abort(sequence)

    start = trio.current_time()
    sequences = []
    for item in plan:
        await trio.sleep_until(start + item.at)
        sequences.append(submit(item))
        if item.hang_up_after is not None:
            nursery.start_soon(hang_up, sequences[-1], item.hang_up_after)
    return sequences


Counts = tuple[int, int, int]  # preemptions, prefix cache hits, preempted hits (tokens)


async def _through_reference(params: EngineParams, plan: Sequence[Submission], seconds: float) -> tuple[Timings, Counts]:
    engine = Engine(params)

    def submit(s: Submission) -> EngineSequence:
        return engine.submit(s.prompt_tokens, MAX_TOKENS[s.kind], prompt_key=s.prompt_key, cache_salt=s.cache_salt, ignore_eos=True)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        sequences = await _submit_all(nursery, plan, submit, engine.abort)
        await trio.sleep_until(trio.current_time() + seconds - plan[-1].at)
        nursery.cancel_scope.cancel()
    stats = engine.statistics()
    counts = (stats.preemptions, stats.prefix_cache_hits, stats.prefix_cache_preempted_hits)
    return [(q.first_token_at, q.finished_at, q.finish_reason) for q in sequences], counts


async def _through_sweep(params: EngineParams, plan: Sequence[Submission], seconds: float, clock: trio.testing.MockClock) -> tuple[Timings, Counts]:
    timeline = Timeline(clock)
    engine = SweepEngine(params, timeline)
    async with trio.open_nursery() as nursery:
        await nursery.start(timeline.run)
        sequences = await _submit_all(
            nursery, plan, lambda s: engine.submit(s.prompt_tokens, MAX_TOKENS[s.kind], block_keys=s.block_keys()), engine.abort
        )
        await trio.sleep_until(trio.current_time() + seconds - plan[-1].at)
        nursery.cancel_scope.cancel()
    stats = engine.statistics()
    counts = (stats.preemptions, stats.prefix_cache_hits, stats.prefix_cache_preempted_hits)
    return [(q.first_token_at, q.finished_at, q.finish_reason) for q in sequences], counts


def _differences(reference: Timings, sweep: Timings) -> tuple[int, float]:
    differing, largest = 0, 0.0
    for mine, theirs in zip(reference, sweep):
        if mine[2] != theirs[2] or (mine[0] is None) != (theirs[0] is None):
            differing += 1
            continue
        for a, b in zip(mine[:2], theirs[:2]):
            if a is not None and b is not None:
                largest = max(largest, abs(a - b))
    return differing, largest


def engine_agreement(
    profile: str,
    rate: float,
    seconds: float,
    *,
    hang_up_share: float = 0.05,
    seed: int = 0,
    documents: int = 0,
    prefix_caching: bool = True,
    kv_cache_tokens: int | None = None,
    scheduler_reserve_full_isl: bool = True,
) -> EngineAgreement:
    """Submit the same seeded traffic to both engines for ``seconds``; compare every timestamp.

    ``documents`` > 0 sends shared-prefix traffic (``submissions``);
    ``kv_cache_tokens`` shrinks the profile's cache, so blocks are evicted;
    ``scheduler_reserve_full_isl=False`` admits on the first chunk's KV (the
    gate before vLLM 0.32's default).
    """
    params = PROFILES[profile].replace(prefix_caching=prefix_caching, scheduler_reserve_full_isl=scheduler_reserve_full_isl)
    if kv_cache_tokens is not None:
        params = params.replace(kv_cache_tokens=kv_cache_tokens)
    plan = submissions(rate, seconds, hang_up_share, seed, documents=documents)
    reference, reference_counts = trio.run(
        _through_reference, params, plan, seconds, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    clock = trio.testing.MockClock(autojump_threshold=0)
    sweep, sweep_counts = trio.run(_through_sweep, params, plan, seconds, clock, clock=clock)
    differing, largest = _differences(reference, sweep)
    return EngineAgreement(
        profile=profile,
        offered_req_per_s=rate,
        seconds=seconds,
        requests=len(plan),
        hang_ups=sum(s.hang_up_after is not None for s in plan),
        preemptions_reference=reference_counts[0],
        preemptions_sweep=sweep_counts[0],
        differing=differing,
        max_difference_s=largest,
        documents=documents,
        prefix_hits_reference=reference_counts[1] + reference_counts[2],
        prefix_hits_sweep=sweep_counts[1] + sweep_counts[2],
    )


def engine_agreements(model: Capacity) -> list[EngineAgreement]:
    """A throughput engine mostly idle, one offered twice its capacity (preemptions), a latency engine past its own,
    and shared-prefix traffic (8 documents) on a throughput engine past its capacity with a cache that evicts."""
    return [
        engine_agreement("throughput", 0.3 * model.req_per_s, 120.0),
        engine_agreement("throughput", 2 * model.req_per_s, 120.0),
        engine_agreement("latency", 3 * model.req_per_s, 60.0),
        engine_agreement("throughput", 2 * model.req_per_s, 120.0, documents=8, kv_cache_tokens=120_000),
    ]


# -- saturation run ------------------------------------------------------------------


@dataclass(frozen=True)
class Saturation:
    offered_req_per_s: float
    completed_req_per_s: float
    warmup_s: float
    window_s: float
    preemptions: int
    max_running: int


async def _saturate(rate: float, warmup: float, seconds: float, seed: int) -> Saturation:
    """Overload one throughput engine (FCFS keeps the mix) and count what it completes."""
    engine = Engine(PROFILES["throughput"], seed=seed)
    short, long = mix_prompt_tokens()
    prompts = {"short": short, "long": long}
    done: list[float] = []

    def on_finish(sequence: EngineSequence) -> None:
        if sequence.finish_reason == "length" and sequence.finished_at is not None:
            done.append(sequence.finished_at)

    engine.add_finish_hook(on_finish)
    rng = random.Random(seed)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        at = start
        number = 0
        while at < start + warmup + seconds:
            at += rng.expovariate(rate)
            kind = "short" if rng.random() < SHORT_SHARE else "long"
            await trio.sleep_until(at)
            body = unique_payload(kind, number, seed=seed)  # unique: the prefix cache must not flatter capacity
            contents = [m["content"] for m in body["messages"]]  # type: ignore[attr-defined]
            engine.submit(prompts[kind], MAX_TOKENS[kind], prompt_key=chat_prompt_key(contents), ignore_eos=True)
            number += 1
        nursery.cancel_scope.cancel()
    lo, hi = start + warmup, start + warmup + seconds
    stats = engine.statistics()
    return Saturation(
        offered_req_per_s=rate,
        completed_req_per_s=sum(lo <= t < hi for t in done) / seconds,
        warmup_s=warmup,
        window_s=seconds,
        preemptions=stats.preemptions,
        max_running=stats.max_running_seen,
    )


def saturation_run(model: Capacity, *, warmup: float = 60.0, seconds: float = 120.0, seed: int = 0) -> Saturation:
    """One engine offered 2x its modelled capacity, in virtual time."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(_saturate, 2 * model.req_per_s, warmup, seconds, seed, clock=clock)


# -- virtual vs real -------------------------------------------------------------------


def quick_mixed_setups() -> list[Setup]:
    """quick_mixed's four set-ups, by its names."""
    return [
        shared(1, name="shared x1"),
        shared(2, name="shared x2 rr"),
        disaggregated(1, 1, name="tailguard"),
        split_direct(1, 1),
    ]


def replay_points(real: Mapping[str, Any]) -> list[Point]:
    """quick_mixed's schedule (its seed, rate, warm-up, window) for each of its set-ups."""
    rate, warmup, seconds, seed = real["rate_req_per_s_real"], real["warmup_s"], real["window_s"], real["seed"]
    arrivals = tuple(Arrival(i, a.at, a.kind, a.measured) for i, a in enumerate(schedule(rate, warmup, seconds, seed)))
    ran = {s["name"] for s in real["setups"]}
    return [
        Point(setup, real["target_load"], rate, warmup, seconds, seed, arrivals=arrivals)
        for setup in quick_mixed_setups()
        if setup.name in ran
    ]


@dataclass(frozen=True)
class Comparison:
    setup: str
    kind: str
    metric: str
    real_ms: float
    virtual_ms: float

    @property
    def ratio(self) -> float:
        return self.virtual_ms / self.real_ms if self.real_ms else float("nan")


def compare(real: Mapping[str, Any], virtual: Sequence[PointResult]) -> list[Comparison]:
    rows: list[Comparison] = []
    by_name = {r.setup: r for r in virtual}
    for setup in real["setups"]:
        mine = by_name.get(setup["name"])
        if mine is None:
            continue
        for theirs in setup["classes"]:
            stats = mine.stats(theirs["kind"])
            if stats is None:
                continue
            for key, label in COMPARED:
                rows.append(Comparison(setup["name"], theirs["kind"], label, theirs[key], getattr(stats, key)))
    return rows


def load_real(path: Path = QUICK_MIXED_JSON) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def comparison_json(rows: Sequence[Comparison]) -> list[dict[str, Any]]:
    return [{**asdict(r), "ratio": r.ratio} for r in rows]
