"""Read a class's objective (``[classes.NAME.objective]``): what it is promised, with safe defaults.

Objectives say what a class needs, not how to get it: attainment
(router/observe/attainment.py) measures them on every request, so an
operator sees whether the pools' rules keep them (placement does not read
them yet). A file
that states none still gets objectives a user would accept: a class with
thresholds serves short, interactive requests (its first token within a
second, ten tokens a second or better, P99); the catch-all serves whatever
is left, promised only its end within ``timeouts.end_to_end_timeout``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .table import Table
from .types import ClassConfig, ObjectiveConfig

# A class with thresholds, when its file states no objective: a chat user's first token within a second,
# the rest at ten tokens a second or better, for 99 of 100 requests.
INTERACTIVE_TTFT = 1.0
INTERACTIVE_ITL = 0.1
DEFAULT_PERCENTILE = 99.0


def read_objective(table: Table, *, interactive: bool, end_to_end: float, queue_timeout: float | None) -> ObjectiveConfig:
    """``[classes.NAME.objective]``; ``interactive``: the class has thresholds (its defaults are a chat's).

    A target of 0 turns that target off. ``e2e`` may not exceed the end-to-end
    timeout (the request is cut there anyway) and must leave room after the
    class's queue; ``ttft`` must come before ``e2e``.
    """
    ttft = _target(table, "ttft", INTERACTIVE_TTFT if interactive else None)
    itl = _target(table, "itl", INTERACTIVE_ITL if interactive else None)
    e2e = table.number("e2e", end_to_end, minimum=0.0)
    if table.ok("e2e") and e2e > end_to_end:
        table.problem("e2e", f"{e2e:g} s is over timeouts.end_to_end_timeout {end_to_end:g} s: the request is cut there")
    if table.ok("e2e") and queue_timeout is not None and e2e <= queue_timeout:
        table.problem("e2e", f"{e2e:g} s must be more than the class's queue_timeout {queue_timeout:g} s (time to run after the queue)")
    if table.ok("ttft", "e2e") and ttft is not None and ttft >= e2e:
        table.problem("ttft", f"{ttft:g} s must be less than e2e {e2e:g} s")
    percentile = table.number("percentile", DEFAULT_PERCENTILE, minimum=0.0)
    if table.ok("percentile") and percentile > 100:
        table.problem("percentile", f"must be at most 100 (the share of requests, in per cent), got {percentile:g}")
    share = table.number("throughput_share", 0.0, minimum=0.0, inclusive=True)
    if table.ok("throughput_share") and share > 1:
        table.problem("throughput_share", f"must be at most 1 (a share of the fleet's output tokens), got {share:g}")
    table.finish()
    return ObjectiveConfig(ttft=ttft, itl=itl, e2e=e2e, percentile=percentile, throughput_share=share)


def check_throughput_shares(classes: Sequence[ClassConfig], table: Table) -> None:
    """The classes' throughput shares may promise at most the whole fleet (a problem reported at ``classes``)."""
    total = sum(klass.objective.throughput_share for klass in classes)
    if total > 1 + 1e-9:
        shares = ", ".join(f"{klass.name} {klass.objective.throughput_share:g}" for klass in classes if klass.objective.throughput_share)
        table.report("classes", f"the classes' objective.throughput_share add up to {total:g} ({shares}): at most 1")


def _target(table: Table, name: str, default: float | None) -> float | None:
    """A target in seconds; 0 (or, where the default is none, leaving it out) means no such target."""
    value = table.number(name, 0.0 if default is None else default, minimum=0.0, inclusive=True)
    return value if value > 0 else None
