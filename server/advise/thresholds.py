"""Interactive-class thresholds to try, from the request sizes a log saw: the file's own, quantile ones, and none.

The file's thresholds (the shipped ones: prompt <= 500 and max_tokens <=
128) fit the traffic they were written for; on a real chat trace 71% of
requests exceed them, on Mooncake nearly all do (issue 23). So advise also
tries bounds cut from the log's own distribution: for a target short share
q (20%, 50%, 80%) one quantile level r is found such that prompt <=
Q_prompt(r) and max_tokens <= Q_max_tokens(r) admit about q of the requests
(both axes at the same level, so neither bound is left wide open; where one
size is the same for every request, that one at its largest and the other
cut), each bound rounded up to two significant figures so it reads as a
setting (more where two would move the share by over a point). A proposal
that would make nearly every request one class (under 5% or over 95% short)
is dropped, as is one within 5 points of a share already proposed; the
file's own thresholds are always kept (they are the operator's), and so is
"no interactive class" (every request batch, one shared pool), which is the
right answer for traffic with no short requests to protect.

At most ``MAX_SETS`` sets, so a search is at most that many times one
layout search.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailguard.router.config import Config

SHARES = (0.2, 0.5, 0.8)  # target short shares of requests for the quantile proposals
MIN_SHARE, MAX_SHARE = 0.05, 0.95  # outside: nearly everything one class (degenerate)
CLOSE = 0.05  # a proposal this near a kept share adds nothing
MAX_SETS = 2 + len(SHARES)  # the file's, the quantile ones, none

Size = tuple[int, int]  # (prompt tokens, max_tokens) of one request


@dataclass(frozen=True)
class Bounds:
    """One set of interactive-class thresholds (None: that side unbounded); ``none``: no request is interactive."""

    label: str
    prompt: int | None
    output: int | None
    none: bool = False

    def admits(self, prompt: int, output: int) -> bool:
        """Whether a request of these sizes is interactive under these bounds (as ``router.admission.admit.classify``)."""
        if self.none:
            return False
        return (self.prompt is None or prompt <= self.prompt) and (self.output is None or output <= self.output)

    def text(self) -> str:
        if self.none:
            return "no interactive class"
        parts = [
            f"prompt <= {self.prompt}" if self.prompt is not None else "",
            f"max_tokens <= {self.output}" if self.output is not None else "",
        ]
        return " and ".join(p for p in parts if p) or "every request"


NO_CLASS = Bounds("none", None, None, none=True)


def file_bounds(config: Config) -> Bounds:
    """The first class's thresholds, as the file sets them."""
    first = config.classes[0]
    return Bounds("file's", first.max_prompt_tokens, first.max_output_tokens)


def shares(sizes: Sequence[Size], bounds: Bounds) -> tuple[float, float]:
    """The short share of the requests, and of their prompt + max_tokens; NaN for no requests."""
    if not sizes:
        return math.nan, math.nan
    short = [p + o for p, o in sizes if bounds.admits(p, o)]
    total = sum(p + o for p, o in sizes)
    return len(short) / len(sizes), (sum(short) / total if total else math.nan)


def nice(value: int, digits: int = 2) -> int:
    """``value`` rounded up to ``digits`` significant figures (at least 1): 1,234 -> 1,300, 87 -> 87."""
    if value < 10**digits:
        return max(1, value)
    step = int(10 ** (len(str(value)) - digits))
    return -(-value // step) * step


def _level(sorted_values: Sequence[int], r: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(r * len(sorted_values)) - 1))]


def _rounded(sizes: Sequence[Size], exact: Bounds) -> Bounds:
    """``exact`` at the fewest significant figures (from two) that keep its short share within a point."""
    share = shares(sizes, exact)[0]
    for digits in range(2, 7):
        bounds = dataclasses.replace(exact, prompt=nice(exact.prompt or 1, digits), output=nice(exact.output or 1, digits))
        if abs(shares(sizes, bounds)[0] - share) <= 0.01:
            return bounds
    return exact


def quantile_bounds(sizes: Sequence[Size], target: float) -> Bounds:
    """Bounds whose short share is nearest ``target``: both sizes cut at one quantile level (bisected), or,
    where that cannot get near (one size the same for every request), one size cut and the other at its largest."""
    prompts, outputs = sorted(p for p, _ in sizes), sorted(o for _, o in sizes)
    label = f"~{target:.0%} short"
    forms: tuple[Callable[[float], Bounds], ...] = (
        lambda r: Bounds(label, _level(prompts, r), _level(outputs, r)),
        lambda r: Bounds(label, _level(prompts, r), outputs[-1]),
        lambda r: Bounds(label, prompts[-1], _level(outputs, r)),
    )
    found: list[Bounds] = []
    for at in forms:
        low, high = 0.0, 1.0
        for _ in range(20):  # the share grows with the level: bisect to ~1e-6
            middle = (low + high) / 2
            if shares(sizes, at(middle))[0] < target:
                low = middle
            else:
                high = middle
        found.append(min((at(low), at(high)), key=lambda b: abs(shares(sizes, b)[0] - target)))
        if abs(shares(sizes, found[0])[0] - target) < CLOSE:  # both sizes cut: the form preferred
            break
    return _rounded(sizes, min(found, key=lambda b: abs(shares(sizes, b)[0] - target)))


def propose(sizes: Sequence[Size], own: Bounds) -> list[Bounds]:
    """The threshold sets to try on traffic of these sizes: ``own`` first, then quantile ones, then none.

    Never more than ``MAX_SETS``; no quantile set with under ``MIN_SHARE`` or
    over ``MAX_SHARE`` short, nor one within ``CLOSE`` of a share kept.
    """
    found = [own]
    kept = [shares(sizes, own)[0]]
    for target in SHARES if sizes else ():
        bounds = quantile_bounds(sizes, target)
        share = shares(sizes, bounds)[0]
        if not MIN_SHARE <= share <= MAX_SHARE or any(abs(share - k) < CLOSE for k in kept if not math.isnan(k)):
            continue
        if any((b.prompt, b.output) == (bounds.prompt, bounds.output) for b in found):
            continue
        found.append(bounds)
        kept.append(share)
    return [*found, NO_CLASS][:MAX_SETS]


def with_bounds(config: Config, bounds: Bounds) -> Config:
    """``config`` with its first class's thresholds replaced; with none, that class admits no request.

    A zero prompt bound is not a valid file setting (the snippet removes the
    class instead), but the router core classifies with it as intended.
    """
    first, *rest = config.classes
    prompt, output = (0, 0) if bounds.none else (bounds.prompt, bounds.output)
    return dataclasses.replace(config, classes=(dataclasses.replace(first, max_prompt_tokens=prompt, max_output_tokens=output), *rest))


def threshold_keys(bounds: Bounds) -> list[str]:
    """The config.toml keys that set these thresholds in the first class's table (none for ``NO_CLASS``: that class goes)."""
    if bounds.none:
        return []
    lines = [f"max_prompt_tokens = {bounds.prompt}"] if bounds.prompt is not None else []
    return lines + ([f"max_output_tokens = {bounds.output}"] if bounds.output is not None else [])
