"""Attainment: each finished request judged against its class's objective, and each class's share met over a minute."""

from __future__ import annotations

import pytest

from tailguard.router.config import ClassConfig, ObjectiveConfig
from tailguard.router.observe import Attainment, RequestRecord, attainment_document, judge

CHAT = ObjectiveConfig(ttft=0.5, itl=0.05, e2e=30.0, percentile=90.0)
BATCH = ObjectiveConfig(ttft=None, itl=None, e2e=120.0, percentile=99.0, throughput_share=0.3)
INTERACTIVE = ClassConfig("interactive", "interactive", 3.0, 0, max_output_tokens=128, objective=CHAT)
LONG = ClassConfig("batch", "batch", 30.0, 1, objective=BATCH)


def served(
    *, ttft: float | None = 0.1, tokens: int = 11, per_token: float = 0.02, arrival: float = 100.0, stream: bool = True, klass: str = "interactive"
) -> RequestRecord:
    """A request that was served: its first token ``ttft`` after ``arrival``, then ``tokens - 1`` more ``per_token`` apart."""
    record = RequestRecord("r", "http", arrival, stream=stream, request_class=klass, outcome="ok")
    first = arrival + (0.1 if ttft is None else ttft)
    record.first_token_at = first
    record.finished_at = first + (tokens - 1) * per_token
    record.completion_tokens = tokens
    return record


def ended(outcome: str, reason: str | None, *, after: float, first_token: float | None = None) -> RequestRecord:
    record = RequestRecord("r", "http", 100.0, stream=True, request_class="interactive")
    record.outcome, record.reason = outcome, reason  # type: ignore[assignment]  # the literal's values, spelled in the cases
    record.finished_at = 100.0 + after
    record.first_token_at = None if first_token is None else 100.0 + first_token
    return record


@pytest.mark.parametrize(
    ("record", "verdict"),
    [
        (served(), True),
        (served(ttft=0.6), False),  # the first token late
        (served(per_token=0.06), False),  # the stream too slow after it
        (served(tokens=1, per_token=1.0), True),  # one token: no inter-token time to judge
        (served(ttft=0.2, tokens=2000, per_token=0.02), False),  # over e2e (40 s)
        (served(ttft=0.6, stream=False), False),  # a whole answer: its end is its first token
        (ended("overloaded", "queue_timeout", after=3.0), False),  # tailguard could not serve it
        (ended("backend_error", "backend_unavailable", after=0.2), False),
        (ended("timeout", "e2e_timeout", after=30.0), False),
        (ended("rejected", "input_cap", after=0.0), None),  # what it was, not placement
        (ended("overloaded", "token_budget", after=0.0), None),  # its caller's own budget
        (ended("overloaded", "caller_limit", after=0.0), None),
        (ended("timeout", "caller_stalled", after=9.0, first_token=0.1), None),
        (ended("cancelled", "client_cancelled", after=0.3), None),  # left before it was late
        (ended("cancelled", "client_cancelled", after=0.9), False),  # left with no first token past ttft
        (ended("cancelled", "client_cancelled", after=0.9, first_token=0.2), None),
    ],
)
def test_a_finished_request_is_judged_against_every_target_it_has(record: RequestRecord, verdict: bool | None) -> None:
    assert judge(record, CHAT) is verdict


def test_a_class_without_a_first_token_target_is_judged_by_its_end_only() -> None:
    assert judge(served(ttft=20.0, per_token=1.0, klass="batch"), BATCH) is True
    assert judge(ended("cancelled", "client_cancelled", after=60.0), BATCH) is None
    assert judge(served(ttft=100.0, tokens=30, per_token=1.0, klass="batch"), BATCH) is False


def test_attainment_is_the_last_minutes_share_met_against_the_classes_target() -> None:
    attainment = Attainment()
    for index in range(10):  # 9 of 10 met at 100-109 s
        record = served(arrival=100.0 + index, ttft=0.9 if index == 0 else 0.1)
        attainment.observe(record, INTERACTIVE)
        assert record.objective_met is (index != 0)
    shown, batch = attainment.view([INTERACTIVE, LONG], now=112.0)
    assert (shown.judged, shown.met, shown.attainment, shown.target, shown.on_target) == (10, 9, 0.9, 0.9, True)
    assert (batch.judged, batch.attainment, batch.on_target) == (0, None, None)
    # A minute after the miss it has left the window; the totals keep it.
    later = attainment.view([INTERACTIVE], now=161.2)[0]  # the miss ended at 101.1 s, the next at 101.3 s
    assert (later.judged, later.met, later.judged_total, later.met_total, later.on_target) == (9, 9, 10, 9, True)
    assert attainment.view([INTERACTIVE], now=1000.0)[0].judged == 0


def test_a_request_that_is_not_judged_or_has_no_class_counts_nowhere() -> None:
    attainment = Attainment()
    refused = ended("rejected", "input_cap", after=0.0)
    attainment.observe(refused, INTERACTIVE)
    attainment.observe(served(), None)  # refused before a class was decided
    assert refused.objective_met is None
    assert attainment.view([INTERACTIVE], now=101.0)[0].judged_total == 0


def test_each_class_has_its_share_of_the_windows_output_tokens() -> None:
    attainment = Attainment()
    attainment.observe(served(tokens=100), INTERACTIVE)
    attainment.observe(served(tokens=300, ttft=1.0, klass="batch"), LONG)
    interactive, batch = attainment.view([INTERACTIVE, LONG], now=110.0)
    assert (interactive.tokens, batch.tokens) == (100, 300)
    assert (interactive.throughput_share, batch.throughput_share) == (0.25, 0.75)
    document = attainment_document((interactive, batch))
    assert document["batch"] == {
        "window_s": 60.0, "judged": 1, "met": 1, "attainment": 1.0, "target": 0.99, "on_target": True,
        "judged_total": 1, "met_total": 1, "tokens": 300, "throughput_share": 0.75,
    }  # fmt: skip


def test_a_class_a_reload_removed_is_forgotten() -> None:
    attainment = Attainment()
    attainment.observe(served(), INTERACTIVE)
    attainment.forget(["batch"])
    assert attainment.view([INTERACTIVE], now=101.0)[0].judged_total == 0
