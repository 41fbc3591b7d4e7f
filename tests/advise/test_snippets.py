"""Every config snippet ``tailguard advise`` prints, merged into the config as it says, is a config tailguard loads.

A snippet that declares a table twice, or one that leaves the file refused
once pasted, costs the operator the hour advise meant to save them.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tailguard.router.config import Config, load_config, parse_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.candidates import Candidate, candidates
from tailguard.server.advise.cli import main
from tailguard.server.advise.fleet import Fleet, fleet_from
from tailguard.server.advise.joint import Judged, Search, section
from tailguard.server.advise.judge import Figures
from tailguard.server.advise.report import snippet
from tailguard.server.advise.simulate import empty_stats
from tailguard.server.advise.thresholds import NO_CLASS, Bounds, file_bounds
from tailguard.server.advise.verdict import Prediction
from tests.advise.test_cli import _log, _sparse
from tests.advise.test_planner import SMALL_POOLS

Document = dict[str, Any]

QUANTILE = Bounds("~50% short", 1300, 300)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml(table: Document, path: tuple[str, ...] = ()) -> list[str]:
    """``table`` as TOML: its keys, then each sub-table under its dotted header, in the document's order."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", "[" + ".".join(_toml_key(p) for p in (*path, key)) + "]", *_toml(value, (*path, key))]
    return lines


def _merge(into: Document, patch: Document) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def paste(config_text: str, snippet_text: str) -> str:
    """``snippet_text`` merged into ``config_text`` as the snippet says: each table's keys set in the table of
    that name (keys not shown kept), and the tables its comments say to remove removed."""
    patch = tomllib.loads(snippet_text)  # a table declared twice fails here
    document = tomllib.loads(config_text)
    if "remove the other pool's table" in snippet_text:
        for name in [n for n in document["pools"] if n not in patch["pools"]]:
            del document["pools"][name]
    for name in re.findall(r"# .*remove \[classes\.([A-Za-z0-9_-]+)\]", snippet_text):
        del document["classes"][name]
    _merge(document, patch)
    return "\n".join(_toml(document)) + "\n"


def _blocks(text: str) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)


def _search(fleet: Fleet, bounds: Bounds, candidate: Candidate) -> Search:
    """A threshold search whose pick is ``candidate`` under ``bounds`` (the figures do not shape the snippet)."""
    prediction = Prediction(candidate, empty_stats(), math.nan, math.nan, math.nan, 0.0)
    pick = Judged(bounds, prediction, Figures(1.0, 1.0, 1.0, 1.0, 0))
    return Search(fleet, ((bounds, 0.5, 0.5),), (pick,), pick, True, 1, 0.0)


def test_the_shipped_config_round_trips_through_the_tests_writer() -> None:
    """The writer ``paste`` uses changes nothing on its own: what fails below is the snippet's."""
    shipped = SHIPPED_CONFIG.read_text()
    assert parse_config(paste(shipped, "")).classes == load_config(SHIPPED_CONFIG).classes


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    return fleet_from(load_config(SHIPPED_CONFIG), 4)


@pytest.mark.parametrize("bounds", [None, QUANTILE, NO_CLASS], ids=["file's", "quantile", "none"])
def test_every_printed_snippet_pastes_into_the_shipped_config(fleet: Fleet, bounds: Bounds | None) -> None:
    """The layout report's snippet and the threshold section's, for every layout advise may pick."""
    shipped = SHIPPED_CONFIG.read_text()
    for candidate in candidates(fleet):
        if bounds is NO_CLASS and not candidate.shared:
            continue  # under no interactive class the search tries the shared pool alone (joint.search)
        own, chosen = file_bounds(fleet.base), bounds or file_bounds(fleet.base)
        printed = [(snippet(fleet, candidate), own), *((text, chosen) for text in _blocks(section(_search(fleet, chosen, candidate))))]
        for text, meant in printed:
            _check(parse_config(paste(shipped, text), source=candidate.name), candidate, meant)


def _check(config: Config, candidate: Candidate, bounds: Bounds) -> None:
    """What the pasted file runs is the candidate: its engines in its pools, every class routed to one of them."""
    assert sum(len(p.endpoints) for p in config.pools) == candidate.interactive + candidate.batch == 4, candidate.name
    names = {p.name for p in config.pools}
    assert all(k.pool in names for k in config.classes)
    if candidate.shared:
        assert names == {"batch"}
    if bounds.none:
        assert [k.name for k in config.classes] == ["batch"]
    else:
        first = config.classes[0]
        assert (first.name, first.max_prompt_tokens, first.max_output_tokens) == ("interactive", bounds.prompt, bounds.output)


def test_the_snippet_sets_the_recommended_thresholds_once(fleet: Fleet) -> None:
    shared = next(c for c in candidates(fleet) if c.shared)
    (text,) = _blocks(section(_search(fleet, QUANTILE, shared)))
    assert text.count("[classes.interactive]") == 1  # was twice: once routing it to the shared pool, once its bounds
    interactive = parse_config(paste(SHIPPED_CONFIG.read_text(), text)).classes[0]
    assert (interactive.name, interactive.pool) == ("interactive", "batch")
    assert (interactive.max_prompt_tokens, interactive.max_output_tokens) == (1300, 300)
    assert interactive.objective == load_config(SHIPPED_CONFIG).classes[0].objective  # its objective kept


def test_a_real_runs_snippets_paste_into_the_config_it_was_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(SMALL_POOLS)
    log = _log(tmp_path / "tailguard.log", _sparse(60, 5.0))  # an idle fleet: the shared pool wins, with the file's bounds
    assert main(["--access-log", str(log), "--config", str(config)]) == 0
    blocks = _blocks(capsys.readouterr().out)
    assert len(blocks) == 2  # the layout's, and the layout with the thresholds
    for text in blocks:
        assert parse_config(paste(SMALL_POOLS, text)).classes
