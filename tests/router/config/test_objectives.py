"""``[classes.NAME.objective]``: what each class is promised, its safe defaults and the mistakes refused."""

from __future__ import annotations

import pytest

from tailguard.router.config import ObjectiveConfig, parse_config
from tests.helpers.config_text import BASE, edit, problems_of


def objectives(text: str) -> dict[str, ObjectiveConfig]:
    return {klass.name: klass.objective for klass in parse_config(text).classes}


def test_a_file_that_states_none_gets_a_chats_objective_for_classes_with_thresholds_and_the_deadline_for_the_catch_all() -> None:
    stated = objectives(BASE)
    assert stated["interactive"] == ObjectiveConfig(ttft=1.0, itl=0.1, e2e=120.0, percentile=99.0, throughput_share=0.0)
    assert stated["batch"] == ObjectiveConfig(ttft=None, itl=None, e2e=120.0, percentile=99.0, throughput_share=0.0)


def test_the_default_e2e_follows_the_end_to_end_timeout() -> None:
    stated = objectives(edit("end_to_end_timeout = 120", "end_to_end_timeout = 45"))
    assert stated["interactive"].e2e == stated["batch"].e2e == 45.0


def test_stated_targets_are_kept_and_zero_turns_one_off() -> None:
    text = edit("priority = 0\n", "priority = 0\nobjective = { ttft = 0.2, itl = 0, e2e = 10, percentile = 95 }\n")
    text = edit("priority = 1\n", "priority = 1\nobjective = { ttft = 5, throughput_share = 0.4 }\n", text)
    stated = objectives(text)
    assert stated["interactive"] == ObjectiveConfig(ttft=0.2, itl=None, e2e=10.0, percentile=95.0, throughput_share=0.0)
    assert stated["batch"] == ObjectiveConfig(ttft=5.0, itl=None, e2e=120.0, percentile=99.0, throughput_share=0.4)


@pytest.mark.parametrize(
    ("objective", "problem"),
    [
        ("{ e2e = 200 }", "classes.interactive.objective.e2e: 200 s is over timeouts.end_to_end_timeout 120 s"),
        ("{ e2e = 3 }", "classes.interactive.objective.e2e: 3 s must be more than the class's queue_timeout 3 s"),
        ("{ ttft = 20, e2e = 10 }", "classes.interactive.objective.ttft: 20 s must be less than e2e 10 s"),
        ("{ percentile = 120 }", "classes.interactive.objective.percentile: must be at most 100"),
        ("{ percentile = 0 }", "classes.interactive.objective.percentile: must be a number > 0"),
        ("{ itl = -1 }", "classes.interactive.objective.itl: must be a number >= 0"),
        ("{ throughput_share = 1.5 }", "classes.interactive.objective.throughput_share: must be at most 1"),
        ("{ ttf = 1 }", "classes.interactive.objective.ttf: unknown key (did you mean 'ttft'?)"),
        ('"fast"', "classes.interactive.objective: must be a table"),
    ],
)
def test_a_wrong_objective_is_refused_naming_its_key(objective: str, problem: str) -> None:
    found = problems_of(edit("priority = 0\n", f"priority = 0\nobjective = {objective}\n"))
    assert any(line.startswith(problem) for line in found), found


def test_the_classes_may_promise_at_most_the_whole_fleets_throughput() -> None:
    text = edit("priority = 0\n", "priority = 0\nobjective = { throughput_share = 0.6 }\n")
    text = edit("priority = 1\n", "priority = 1\nobjective = { throughput_share = 0.5 }\n", text)
    (problem,) = problems_of(text)
    assert problem.startswith("classes: the classes' objective.throughput_share add up to 1.1 (interactive 0.6, batch 0.5)")
    text = edit("throughput_share = 0.5", "throughput_share = 0.4", text)
    assert sum(o.throughput_share for o in objectives(text).values()) == pytest.approx(1.0)
