"""A trace's arrivals at a target fraction of the fleet's capacity, classed as a config file classes them.

Capacity is the engine model's (``mix.engine_capacity``, the synthetic
mix's ``shared_capacity`` generalised to any sample of (prompt, output)
pairs, with the KV cache bounding the seats): every prompt token is
prefilled, so it ignores the prefix cache, and a trace with real reuse
(Mooncake's) loads the engines less than its nominal fraction. Requests
whose prompt and output exceed the engines' context are left out of every
set-up.

Mooncake keeps its own arrival times, squeezed or stretched so the sample
arrives at the target rate; ShareGPT has lengths only, so its requests are
Poisson arrivals at the target rate, each a pair drawn uniformly (both
seeded: every set-up gets the same arrivals).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness.mooncake import TraceRow
from tailguard.router.config import Config
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.replay.mix import engine_capacity
from tailguard.sim.params import PROFILES, EngineParams

from .mooncake import prompt_text

CONTEXT = 32768  # the simulated engines' max_model_len


@dataclass(frozen=True)
class Thresholds:
    """The interactive class's bounds (None: no bound); a request over either is "long"."""

    prompt: int | None
    output: int | None

    def kind(self, prompt: int, output: int) -> str:
        short = (self.prompt is None or prompt <= self.prompt) and (self.output is None or output <= self.output)
        return "short" if short else "long"


def thresholds(config: Config) -> Thresholds:
    """The first class with a bound, as the router tries classes in file order (the shipped one: 500 and 128)."""
    for cls in config.classes:
        if cls.max_prompt_tokens is not None or cls.max_output_tokens is not None:
            return Thresholds(cls.max_prompt_tokens, cls.max_output_tokens)
    return Thresholds(None, None)


def fits(prompt: int, output: int) -> bool:
    """Whether the engines' context holds the prompt and its output."""
    return prompt + output <= CONTEXT


def pairs_capacity(pairs: Sequence[tuple[int, int]], params: EngineParams = PROFILES["throughput"]) -> float:
    """Requests/s one engine sustains for requests drawn uniformly from ``pairs`` = [(prompt, output)], every seat busy."""
    return engine_capacity(params, [(1.0, prompt, output) for prompt, output in pairs])


@dataclass(frozen=True)
class Workload:
    """One trace at one load: its arrivals and what they were scaled to."""

    arrivals: tuple[Arrival, ...]
    rate: float  # offered req/s
    capacity_per_engine: float  # req/s, the engine model's, no prefix cache
    left_out: int  # requests over the context


def mooncake(rows: Sequence[TraceRow], engines: int, load: float, classes: Thresholds, *, reuse: bool = True) -> Workload:
    """The rows that fit, their timestamps scaled so they arrive at ``load`` of ``engines``' capacity.

    With ``reuse`` each prompt is built from its ``hash_ids`` (the prefix
    cache sees the trace's reuse); else the fleet sends unique filler.
    """
    kept = [row for row in rows if fits(row.input_length, max(1, row.output_length))]
    capacity = pairs_capacity([(row.input_length, max(1, row.output_length)) for row in kept])
    rate = load * engines * capacity
    if len(kept) < 2 or kept[-1].timestamp_ms <= kept[0].timestamp_ms:
        raise ValueError("a trace needs two requests at different times to be scaled")
    origin = kept[0].timestamp_ms
    span = (kept[-1].timestamp_ms - origin) / 1000
    stretch = len(kept) / rate / span  # n requests over n / rate seconds
    out: list[Arrival] = []
    for index, row in enumerate(kept):
        prompt, output = row.input_length, max(1, row.output_length)
        text = prompt_text(row.hash_ids, prompt) if reuse else None
        at = (row.timestamp_ms - origin) / 1000 * stretch
        out.append(Arrival(index, at, classes.kind(prompt, output), True, prompt, output, text))
    return Workload(tuple(out), rate, capacity, len(rows) - len(kept))


def sharegpt(pairs: Sequence[tuple[int, int]], count: int, engines: int, load: float, classes: Thresholds, *, seed: int = 0) -> Workload:
    """``count`` Poisson arrivals at ``load`` of ``engines``' capacity, each a pair that fits drawn uniformly."""
    kept = [(prompt, max(1, output)) for prompt, output in pairs if fits(prompt, max(1, output))]
    capacity = pairs_capacity(kept)
    rate = load * engines * capacity
    rng = random.Random(seed)
    at = 0.0
    out: list[Arrival] = []
    for index in range(count):
        at += rng.expovariate(rate)
        prompt, output = kept[rng.randrange(len(kept))]
        out.append(Arrival(index, at, classes.kind(prompt, output), True, prompt, output))
    return Workload(tuple(out), rate, capacity, len(pairs) - len(kept))
