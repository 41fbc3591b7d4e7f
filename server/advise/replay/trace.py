"""Arrival schedules in real seconds, and traces of them on disk in GPU seconds.

Times inside a schedule are real seconds; a trace on disk is in GPU seconds
(real seconds divided by the simulator's time scale), so a trace recorded at
one time scale replays the same GPU load at another. ``bench tail
--record-trace`` writes one; ``bench tail --trace`` and ``tailguard advise
--trace`` read it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .mix import Shape, kind_of, origin_mix

MAX_ARRIVALS = 50_000  # a hard bound on any schedule


@dataclass(frozen=True)
class Arrival:
    at: float  # real seconds after the start
    kind: str  # the reporting class: "short" or "long"
    prompt: int  # prompt tokens (the simulator's count)
    max_tokens: int
    measured: bool  # arrived after the warm-up



def generated(
    rate: float, warmup: float, seconds: float, seed: int, bursty_period: float | None, shapes: Sequence[Shape] | None = None
) -> list[Arrival]:
    """``shapes`` (default: the origin's mix) at ``rate`` req/s real: Poisson, or on/off (2x rate for half of each period, then silence)."""
    return phased([(warmup + seconds, rate, shapes or origin_mix())], warmup, seed, bursty_period)


def phased(
    phases: Sequence[tuple[float, float, Sequence[Shape]]], warmup: float, seed: int, bursty_period: float | None = None
) -> list[Arrival]:
    """Poisson arrivals phase after phase: each (real s long, req/s real, shapes); measured after ``warmup`` real s.

    A mix that shifts mid-run (issue 12) is two phases; one phase is plain
    ``generated``, which draws the same arrivals as before for the origin's mix.
    """
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    start = 0.0
    for length, rate, shapes in phases:
        peak = rate * 2 if bursty_period else rate
        weights = [share for _, share, _, _ in shapes]
        at = start + rng.expovariate(peak)
        while at < start + length and len(arrivals) < MAX_ARRIVALS:
            kind, _, prompt, out = _pick(rng, shapes, weights)
            if not bursty_period or at % bursty_period < bursty_period / 2:
                arrivals.append(Arrival(at, kind, prompt, out, measured=at >= warmup))
            at += rng.expovariate(peak)
        start += length
    return arrivals


def _pick(rng: random.Random, shapes: Sequence[Shape], weights: Sequence[float]) -> Shape:
    """One shape by share; with the origin's two shapes, the same draw the first tail used (short if below its share)."""
    draw = rng.random() * sum(weights)
    for shape, weight in zip(shapes, weights):
        if draw < weight:
            return shape
        draw -= weight
    return shapes[-1]


def read_trace(path: Path, time_scale: float, warmup: float, seconds: float) -> list[Arrival]:
    """JSONL lines {"at": GPU s, "prompt_tokens": n, "max_tokens": m, "class": "short"|"long"}, cut to warm-up + window."""
    arrivals: list[Arrival] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, max_tokens, at = int(row["prompt_tokens"]), int(row["max_tokens"]), float(row["at"]) * time_scale
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: {error!r}") from None
        if at >= warmup + seconds or len(arrivals) >= MAX_ARRIVALS:
            break
        kind = str(row.get("class") or kind_of(prompt, max_tokens))
        arrivals.append(Arrival(at, kind, prompt, max_tokens, measured=at >= warmup))
    return sorted(arrivals, key=lambda a: a.at)


def write_trace(path: Path, arrivals: Sequence[Arrival], time_scale: float) -> None:
    """The schedule as a replayable trace (GPU seconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = (
        json.dumps({"at": round(a.at / time_scale, 6), "prompt_tokens": a.prompt, "max_tokens": a.max_tokens, "class": a.kind})
        for a in arrivals
    )
    path.write_text("\n".join(rows) + "\n")


def mix_of(arrivals: Sequence[Arrival]) -> dict[str, list[tuple[float, int, int]]]:
    """The schedule's shapes and their shares, by class (shares of all arrivals)."""
    counts: dict[tuple[str, int, int], int] = {}
    for a in arrivals:
        counts[(a.kind, a.prompt, a.max_tokens)] = counts.get((a.kind, a.prompt, a.max_tokens), 0) + 1
    mix: dict[str, list[tuple[float, int, int]]] = {}
    for (kind, prompt, out), n in counts.items():
        mix.setdefault(kind, []).append((n / len(arrivals), prompt, out))
    return mix
