"""``bench tail --lend-rule``: every key of ``[pools.X.lend]`` the shipped file sets can be measured in real time."""

from __future__ import annotations

import pytest

from bench.tail.model import LendRule
from tailguard.router.config import parse_config
from tests.test_config import BASE


def test_a_rule_with_the_stall_bound_and_when_reaches_the_config_it_writes() -> None:
    rule = LendRule.parse("reserve=4,prefills=1,when=busier")
    assert (rule.reserve, rule.prefills, rule.when, rule.max_prompt_tokens) == (4, 1, "busier", None)
    assert rule.label() == "p- r4 f1 busier"
    lend = parse_config(BASE + "\n" + "\n".join(rule.toml("interactive", "batch"))).pool("interactive").lend
    assert (lend.to, lend.reserve, lend.prefills, lend.when) == (("batch",), 4, 1, "busier")


def test_a_rule_without_when_lends_as_before_and_a_bad_when_is_refused() -> None:
    assert LendRule.parse("prompt=512,reserve=4") == LendRule(max_prompt_tokens=512, reserve=4)
    with pytest.raises(ValueError, match="when is full or busier"):
        LendRule.parse("when=always")
