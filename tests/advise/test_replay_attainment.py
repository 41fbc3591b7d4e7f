"""The replay's attainment: each kind of request judged by the shipped config's promise, the same for every placement."""

from __future__ import annotations

import pytest

from tailguard.router.config import ObjectiveConfig, load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.replay.fleet import Record
from tailguard.server.advise.replay.point import met, shipped_objectives, summarize

CHAT = ObjectiveConfig(ttft=0.5, itl=0.05, e2e=30.0)


def served(ttft: float, e2e: float, tokens: int, kind: str = "short") -> Record:
    return Record(kind, True, outcome="ok", ttft=ttft, e2e=e2e, tokens=tokens)


@pytest.mark.parametrize(
    ("record", "verdict"),
    [
        (served(0.1, 1.0, 19), True),  # 0.05 s a token after the first
        (served(0.6, 1.0, 19), False),  # the first token late
        (served(0.1, 1.5, 19), False),  # the stream too slow (0.078 s a token)
        (served(0.1, 0.1, 1), True),  # one token: no inter-token time
        (served(0.1, 31.0, 1000), False),  # past e2e
        (Record("short", True, outcome="503"), False),  # refused: missed
        (Record("short", True, outcome="timeout", ttft=0.1), False),
    ],
)
def test_a_request_meets_the_objective_when_served_within_every_target(record: Record, verdict: bool) -> None:
    assert met(record, CHAT) is verdict


def test_the_kinds_are_judged_by_the_shipped_classes_promises() -> None:
    classes = load_config(SHIPPED_CONFIG).classes
    assert shipped_objectives() == {"short": classes[0].objective, "long": classes[-1].objective}


def test_attainment_counts_every_request_of_the_kind_failures_as_missed() -> None:
    objective = shipped_objectives()["short"]
    quick = served(objective.ttft or 0.1, 0.5, 2)
    late = served((objective.ttft or 0.1) * 3, 2.0, 2)
    refused = Record("short", True, outcome="429")
    stats = summarize([quick, late, refused, served(0.1, 5.0, 10, kind="long")], "short", seconds=10.0)
    assert (stats.n, stats.ok, stats.attained) == (3, 2, 1)
    assert stats.attainment == pytest.approx(1 / 3)
