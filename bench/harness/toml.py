"""TOML text from plain data: the one writer behind every config file a benchmark generates.

tomllib reads TOML but writes none, and the benchmarks need no more than this
small subset, so no writer dependency is added: a document is a mapping whose
mapping values are tables (``[a.b]`` headers, nested tables after their
parent's keys) and whose lists are arrays, of scalars or of inline tables
(``endpoints = [{ url = "...", max_concurrency = 4 }]``, which TOML reads as
the same values as ``[[a.endpoints]]`` tables). An empty mapping is written as
its header alone, so it still exists for the reader.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TypeAlias

TomlScalar: TypeAlias = str | int | float | bool
TomlValue: TypeAlias = "TomlScalar | Sequence[TomlValue] | Mapping[str, TomlValue]"
TomlTable: TypeAlias = Mapping[str, TomlValue]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps(document: TomlTable) -> str:
    """``document`` as TOML text; raises TypeError for what TOML cannot say (None, a non-string key)."""
    lines: list[str] = []
    _table(lines, (), document)
    return "\n".join(lines) + "\n"


def _table(lines: list[str], path: tuple[str, ...], table: TomlTable) -> None:
    """The table's own keys under its header, then each sub-table (a header only where it has keys, or none at all)."""
    own = [(key, value) for key, value in table.items() if not isinstance(value, Mapping)]
    subtables = [(key, value) for key, value in table.items() if isinstance(value, Mapping)]
    if path and (own or not subtables):
        lines += ["", f"[{'.'.join(_key(part) for part in path)}]"]
    lines += [f"{_key(key)} = {_value(value)}" for key, value in own]
    for key, sub in subtables:
        _table(lines, (*path, key), sub)


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a TOML key must be a string, not {key!r}")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: object) -> str:
    """One value on the right of ``=``: a scalar, an array, or an inline table."""
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise TypeError(f"TOML has no value for {value!r}")


def _float(value: float) -> str:
    """repr's shortest round-tripping digits, always with a point or exponent so it reads back as a float."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = repr(value)
    return text if any(c in text for c in ".eE") else text + ".0"


def _string(text: str) -> str:
    """A basic (double-quoted) string: quote, backslash and control characters escaped."""
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def merged(*tables: TomlTable) -> dict[str, TomlValue]:
    """One document from parts: tables of the same name merged key by key (a later part's value wins), in first-seen order."""
    out: dict[str, TomlValue] = {}
    for table in tables:
        for key, value in table.items():
            mine = out.get(key)
            if isinstance(mine, Mapping) and isinstance(value, Mapping):
                out[key] = merged(mine, value)
            else:
                out[key] = value
    return out
