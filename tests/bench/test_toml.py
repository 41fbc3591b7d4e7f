"""The harness's TOML writer: what it writes reads back (tomllib) as the same values, of the same types."""

from __future__ import annotations

import math
import tomllib

import pytest

from bench.harness.toml import TomlTable, dumps, merged

DOCUMENT: TomlTable = {
    "server": {"http_listen": "127.0.0.1:8080", "reload_poll_interval": 0, "max_connections": 4096},
    "timeouts": {"end_to_end_timeout": 3.0, "retry_after": 0.1 * 3, "tiny": 1e-300, "big": 1.5e300, "negative": -2.5},
    "empty": {},
    "pools": {
        "interactive": {
            "models": ["sim-llama-3.1-8b"],
            "vllm_priority": True,
            "movable": False,
            "class_max_concurrency": {"batch": 4},
            "endpoints": [{"url": "http://127.0.0.1:1", "max_concurrency": 8, "movable": True}, {"url": "http://127.0.0.1:2", "max_concurrency": 8}],
            "lend": {"to": ["batch"], "reserve": 4},
        },
    },
    "auth": {"keys": [{"name": "a", "weight": 3.0}, {"name": "b", "weight": 1.0}]},
    "strings": {"quote": 'say "hi"', "backslash": "C:\\path", "lines": "one\ntwo\r\n", "control": "\x00\x07\x1f\x7f", "unicode": "tëst ☃", "tab": "a\tb"},
    "odd keys": {"a.b": 1, "": 2, "é": 3},
    "arrays": {"empty": [], "nested": [[1, 2], ["x"]], "inline_empty": [{}]},
}


def _typed(value: object) -> object:
    """The value with every scalar paired with its type, so 3 and 3.0 (equal to Python) compare unequal."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


def test_a_document_reads_back_as_the_same_values_and_types() -> None:
    assert _typed(tomllib.loads(dumps(DOCUMENT))) == _typed(DOCUMENT)


def test_tables_keep_their_order_for_a_reader_that_depends_on_it() -> None:
    """tailguard tries classes in file order: the writer must not sort them."""
    classes = {"classes": {"short": {"pool": "all"}, "all": {"pool": "all"}, "batch": {"pool": "b"}}}
    assert list(tomllib.loads(dumps(classes))["classes"]) == ["short", "all", "batch"]


def test_a_whole_float_stays_a_float_and_a_bool_stays_a_bool() -> None:
    read = tomllib.loads(dumps({"t": {"f": 3.0, "i": 3, "b": True}}))["t"]
    assert (type(read["f"]), type(read["i"]), type(read["b"])) == (float, int, bool)


def test_infinity_and_nan_are_written_as_toml_spells_them() -> None:
    read = tomllib.loads(dumps({"inf": math.inf, "ninf": -math.inf, "nan": math.nan}))
    assert read["inf"] == math.inf and read["ninf"] == -math.inf and math.isnan(read["nan"])


@pytest.mark.parametrize("value", [None, object(), {1: "x"}])
def test_what_toml_cannot_say_is_refused(value: object) -> None:
    with pytest.raises(TypeError):
        dumps({"key": value})  # type: ignore[dict-item]


def test_an_empty_table_is_written_so_that_it_exists() -> None:
    assert tomllib.loads(dumps({"timeouts": {}, "metrics": {"x": 1}})) == {"timeouts": {}, "metrics": {"x": 1}}


def test_merged_joins_tables_of_one_name_and_a_later_value_wins() -> None:
    first: TomlTable = {"server": {"a": 1, "b": 2}, "pools": {"p": {"x": 1}}}
    second: TomlTable = {"server": {"b": 3}, "pools": {"p": {"lend": {"to": ["q"]}}}, "classes": {}}
    assert merged(first, second) == {"server": {"a": 1, "b": 3}, "pools": {"p": {"x": 1, "lend": {"to": ["q"]}}}, "classes": {}}
    assert list(merged(first, second)) == ["server", "pools", "classes"]
