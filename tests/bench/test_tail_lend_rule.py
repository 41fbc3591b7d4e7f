"""``bench tail --lend-rule``: every key of ``[pools.X.lend]`` the shipped file sets can be measured in real time."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.toml import dumps
from bench.tail.model import LendRule, Options
from bench.tail.setups import build_setups
from tailguard.router.config import parse_config
from tests.helpers.config_text import BASE


def test_a_rule_with_the_stall_bound_and_when_reaches_the_config_it_writes() -> None:
    rule = LendRule.parse("reserve=4,prefills=1,when=busier")
    assert (rule.reserve, rule.prefills, rule.when, rule.max_prompt_tokens) == (4, 1, "busier", None)
    assert rule.label() == "p- r4 f1 busier"
    lend = parse_config(BASE + "\n" + dumps(rule.table("interactive", "batch"))).pool("interactive").lend
    assert (lend.to, lend.reserve, lend.prefills, lend.when) == (("batch",), 4, 1, "busier")


def test_a_rule_without_when_lends_as_before_and_a_bad_when_is_refused() -> None:
    assert LendRule.parse("prompt=512,reserve=4") == LendRule(max_prompt_tokens=512, reserve=4)
    with pytest.raises(ValueError, match="when is full or busier"):
        LendRule.parse("when=always")


@pytest.mark.parametrize("profile", ["latency", "throughput"])
def test_the_interactive_engines_profile_is_the_options(profile: str, tmp_path: Path) -> None:
    options = Options(
        engines=4, split=(1, 3), loads=(0.9,), traffic="poisson", burst_period=10.0, trace=None, record_trace=None, warmup=1.0,
        seconds=1.0, drain=1.0, time_scale=4.0, seed=0, setups=("lend",), out=tmp_path, name="t", interactive_profile=profile,
    )
    [setup] = build_setups(options)
    assert setup.engines is not None and [kind for _, kind in setup.engines] == [profile, "throughput", "throughput", "throughput"]
