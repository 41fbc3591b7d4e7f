"""Checks the sweep leans on: the shared fleet's capacity, and virtual vs real time.

- Capacity: the analytic figure ``quick_mixed.shared_capacity`` computes, and
  a saturation run of one throughput engine in virtual time (offered twice
  its capacity, completions counted over a window) to confirm it.
- Virtual vs real: ``bench/quick_mixed.py``'s exact arrival schedule (same
  seed, rate, warm-up and window) replayed through the same set-ups in
  virtual time, next to its real-time results.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio
import trio.testing

from bench.quick_mixed import SHORT_SHARE, Capacity, payloads, prompt_tokens, schedule, shared_capacity
from bench.sim import PROFILES, Engine
from bench.sim import Sequence as EngineSequence

from .sweep_sim import MAX_TOKENS, Arrival, Point, PointResult, Setup, disaggregated, shared, split_direct

QUICK_MIXED_JSON = Path(__file__).resolve().parent / "results" / "quick_mixed.json"
COMPARED = (("ttft_p50_ms", "TTFT P50"), ("ttft_p99_ms", "TTFT P99"), ("e2e_p50_ms", "E2E P50"), ("e2e_p99_ms", "E2E P99"))


def mix_prompt_tokens() -> tuple[int, int]:
    """The simulator's prompt sizes of the short and long payloads (20 and 2,021)."""
    bodies = payloads()
    return prompt_tokens(bodies["short"]), prompt_tokens(bodies["long"])


def model_capacity() -> Capacity:
    """One throughput engine's capacity for the mix, from the cost model (as quick_mixed uses)."""
    return shared_capacity(PROFILES["throughput"], *mix_prompt_tokens())


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
        while at < start + warmup + seconds:
            at += rng.expovariate(rate)
            kind = "short" if rng.random() < SHORT_SHARE else "long"
            await trio.sleep_until(at)
            engine.submit(prompts[kind], MAX_TOKENS[kind], prompt_key=kind, ignore_eos=True)
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
