"""Read one TOML table with types, collecting problems under dotted keys instead of raising.

Every section reader goes through :class:`Table`, so every problem names its
dotted key, an unknown key is refused with a suggestion, and all problems of a
file come out together.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = ["ENV_NAME", "NAME", "Table", "as_mapping", "as_table", "describe", "join_key", "kind"]

_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)

# What a pool, class or key name may hold.
NAME = re.compile(r"[A-Za-z0-9_.-]+")
# What names an environment variable (key_env, keys_file_env, api_key_env).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class Table:
    """One TOML table being read: knows its dotted path and collects problems.

    Every reader registers its key as known (so :meth:`finish` can name the
    unknown ones) and returns a value of the right type even when the input is
    wrong, so a section can always be built; :func:`parse_config` refuses the
    whole file if any problem was collected.
    """

    def __init__(self, data: Mapping[str, object], path: str, problems: list[str]) -> None:
        self._data = data
        self.path = path
        self._problems = problems
        self._start = len(problems)
        self._known: set[str] = set()
        self._bad: set[str] = set()

    def key(self, name: str) -> str:
        """The dotted key of ``name`` in this table, quoted as TOML would need."""
        return join_key(self.path, name)

    def has(self, name: str) -> bool:
        return name in self._data

    def peek(self, name: str) -> object:
        """The raw value of ``name`` (None: absent), read without checking it: for cross checks before the key's own reader."""
        return self._data.get(name)

    def names(self) -> list[str]:
        """The keys present, in file order."""
        return list(self._data)

    def report(self, key: str, message: str) -> None:
        """Record a problem about any dotted ``key``."""
        self._problems.append(f"{key}: {message}")

    def problem(self, name: str, message: str) -> None:
        """Record a problem about this table's key ``name`` and mark it bad."""
        self.report(self.key(name), message)
        self._bad.add(name)

    def invalidate(self, name: str) -> None:
        """Mark ``name`` bad without a problem of its own (one was reported below it)."""
        self._bad.add(name)

    def ok(self, *names: str) -> bool:
        """Whether all these keys were read without a problem (for cross checks)."""
        return self._bad.isdisjoint(names)

    def finish(self) -> bool:
        """Report unknown keys; True if nothing in or below this table was wrong."""
        for name in self._data:
            if name not in self._known:
                hint = difflib.get_close_matches(name, sorted(self._known), n=1)
                suffix = f" (did you mean {hint[0]!r}?)" if hint else ""
                self.problem(name, f"unknown key{suffix}")
        return len(self._problems) == self._start

    def _read(
        self,
        name: str,
        expect: str,
        convert: Callable[[object], _T | None],
        default: _T | None,
        fallback: _T,
    ) -> _T:
        """The converted value of ``name``, its default if absent, else ``fallback``."""
        self._known.add(name)
        value = self._data.get(name)
        if value is None:  # TOML has no null: None means absent
            if default is None:
                self.problem(name, f"missing: must be {expect}")
                return fallback
            return default
        converted = convert(value)
        if converted is None:
            self.problem(name, f"must be {expect}, got {describe(value)}")
            return fallback
        return converted

    def integer(self, name: str, default: int | None = None, *, minimum: int | None = None) -> int:
        expect = "an integer" if minimum is None else f"an integer >= {minimum}"

        def convert(value: object) -> int | None:
            if isinstance(value, bool) or not isinstance(value, int):
                return None
            return value if minimum is None or value >= minimum else None

        return self._read(name, expect, convert, default, 0 if minimum is None else minimum)

    def optional_integer(self, name: str, *, minimum: int) -> int | None:
        """An integer that may be left out (``None``), as a class threshold may."""
        if name not in self._data:
            self._known.add(name)
            return None
        return self.integer(name, minimum=minimum)

    def number(
        self, name: str, default: float | None = None, *, minimum: float, inclusive: bool = False
    ) -> float:
        """A finite float or integer above ``minimum`` (or equal, if ``inclusive``)."""
        expect = f"a number {'>=' if inclusive else '>'} {minimum:g}"

        def convert(value: object) -> float | None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            number = float(value)
            if not math.isfinite(number):
                return None
            return number if number > minimum or (inclusive and number == minimum) else None

        return self._read(name, expect, convert, default, max(minimum, 1.0))

    def optional_number(self, name: str, *, minimum: float) -> float | None:
        """A number above ``minimum`` that may be left out (``None``: unknown)."""
        if name not in self._data:
            self._known.add(name)
            return None
        return self.number(name, minimum=minimum)

    def boolean(self, name: str, default: bool) -> bool:
        def convert(value: object) -> bool | None:
            return value if isinstance(value, bool) else None

        return self._read(name, "true or false", convert, default, default)

    def string(self, name: str, default: str | None = None) -> str:
        def convert(value: object) -> str | None:
            return value if isinstance(value, str) else None

        return self._read(name, "a string", convert, default, "")

    def optional_string(self, name: str) -> str | None:
        if name not in self._data:
            self._known.add(name)
            return None
        return self.string(name)

    def secret(self, name: str) -> str | None:
        """A string that may be a key: absent is None, and a wrong one is never quoted."""
        self._known.add(name)
        value = self._data.get(name)
        if value is None or isinstance(value, str):
            return value
        self.problem(name, f"must be a string, got {kind(value)} (its value is not shown)")
        return None

    def choice(self, name: str, options: tuple[_S, ...], default: _S | None = None) -> _S:
        expect = "one of " + ", ".join(json.dumps(option) for option in options)

        def convert(value: object) -> _S | None:
            return next((option for option in options if option == value), None)

        return self._read(name, expect, convert, default, options[0])

    def array(self, name: str, expect: str, default: list[object] | None = None) -> list[object]:
        def convert(value: object) -> list[object] | None:
            return list(value) if isinstance(value, list) else None

        return self._read(name, expect, convert, default, [])

    def tables_in(self, name: str, expect: str, default: list[object] | None = None) -> list[Table]:
        """The tables of array ``name``; an item that is not a table is reported, skipped, and marks ``name`` bad."""
        tables: list[Table] = []
        for index, item in enumerate(self.array(name, expect, default)):
            key = f"{self.key(name)}[{index}]"
            table = self.nested(key, item)
            if table is None:
                self.report(key, f"must be a table, got {describe(item)}")
                self.invalidate(name)
                continue
            tables.append(table)
        return tables

    def mapping(self, name: str, expect: str) -> Mapping[str, object]:
        """An optional table of free-form keys (``[tracing.headers]``), its keys unchecked here."""
        return self._read(name, expect, as_mapping, {}, {})

    def table(self, name: str) -> Table:
        """An optional sub-table; an absent one reads as empty, so defaults apply."""
        data: Mapping[str, object] = self._read(name, "a table", as_mapping, {}, {})
        return Table(data, self.key(name), self._problems)

    def nested(self, key: str, value: object) -> Table | None:
        """``value`` as a table at dotted ``key`` (an array item), or None if it is not one."""
        return as_table(value, key, self._problems)

    def children(self, name: str, *, noun: str) -> list[tuple[str, Table]]:
        """The required ``[name.NAME]`` tables, in file order, their names checked."""
        expect = f"a table with at least one [{name}.NAME] {noun}"

        def convert(value: object) -> Mapping[str, object] | None:
            return as_mapping(value) or None  # an empty table is as bad as none

        data: Mapping[str, object] = self._read(name, expect, convert, None, {})
        parent = Table(data, self.key(name), self._problems)
        children: list[tuple[str, Table]] = []
        for child_name, value in parent._data.items():
            parent._known.add(child_name)
            child = parent.nested(parent.key(child_name), value)
            if child is None:
                parent.problem(child_name, f"must be a table (a {noun}), got {describe(value)}")
                continue
            if not NAME.fullmatch(child_name):
                parent.problem(child_name, f"{noun} name must match {NAME.pattern}")
            children.append((child_name, child))
        return children


def as_mapping(value: object) -> Mapping[str, object] | None:
    if not isinstance(value, dict):
        return None
    return {str(key): item for key, item in value.items()}


def as_table(value: object, path: str, problems: list[str]) -> Table | None:
    mapping = as_mapping(value)
    return None if mapping is None else Table(mapping, path, problems)


def join_key(path: str, name: str) -> str:
    """``path.name``, with ``name`` quoted when it is not a bare TOML key."""
    part = name if _BARE_KEY.fullmatch(name) else json.dumps(name)
    return f"{path}.{part}" if path else part


def kind(value: object) -> str:
    """A value's TOML type without the value, for what may be a secret."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, (dict, list)):
        return describe(value)
    return "a date or time"


def describe(value: object) -> str:
    """A value as it was written in TOML (``0``, ``"10"``, ``true``), so its type shows."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


