"""Read ``config.toml`` into the frozen objects of :mod:`router.config_types`.

The reader is written by hand rather than with a schema library because of
three promises to the operator: every problem names its dotted key
(``pools.batch.endpoints[1].max_concurrency``); an unknown key is refused (a
typo silently ignored is a cap silently not applied); and all problems come
out together, so one edit fixes the file. Parsing and validating are one pass:
each table is read through a :class:`_Table` that collects problems instead of
raising, and a cross check runs only when the values it compares are valid, so
one mistake is reported once.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar, get_args
from urllib.parse import urlsplit

import tomli

from .config_types import (
    ClassConfig,
    Config,
    EndpointConfig,
    EstimateConfig,
    LimitsConfig,
    OverCapMode,
    PoolConfig,
    ServerConfig,
    SimulateProfile,
    TimeoutsConfig,
)

__all__ = ["ConfigError", "limits_document", "load_config", "parse_config", "render_config"]

_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_OVER_CAP_MODES: tuple[OverCapMode, ...] = get_args(OverCapMode)
_SIMULATE_PROFILES: tuple[SimulateProfile, ...] = get_args(SimulateProfile)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class ConfigError(Exception):
    """The configuration was refused; ``problems`` has one line per problem.

    Each line starts with the dotted key it is about, so an operator can find
    it in the file; ``str()`` lists them all under the source's name.
    """

    def __init__(self, problems: Iterable[str], *, source: str = "<string>") -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.source = source
        count = len(self.problems)
        header = f"{source}: configuration refused, {count} problem{'s' if count != 1 else ''}:"
        super().__init__("\n".join([header, *(f"  {line}" for line in self.problems)]))


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate the configuration file at ``path``.

    Raises :exc:`ConfigError` if the file cannot be read, is not UTF-8 TOML,
    or fails validation.
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror or exc}"], source=source) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text: {exc}"], source=source) from exc
    return parse_config(text, source=source)


def parse_config(text: str, *, source: str = "<string>") -> Config:
    """Parse and validate TOML ``text``; ``source`` names it in error messages.

    Raises :exc:`ConfigError` listing every problem found.
    """
    try:
        document = tomli.loads(text)
    except tomli.TOMLDecodeError as exc:
        raise ConfigError([f"invalid TOML: {exc}"], source=source) from exc
    problems: list[str] = []
    root = _Table(document, "", problems)
    server = _read_server(root.table("server"))
    estimate = _read_estimate(root.table("estimate"))
    limits_table, timeouts_table = root.table("limits"), root.table("timeouts")
    limits = _read_limits(limits_table)
    timeouts = _read_timeouts(timeouts_table)
    # Cross checks use a value only if it was valid, so one mistake is one problem.
    input_cap = limits.input_cap_tokens if limits_table.ok("input_cap_tokens") else None
    end_to_end = timeouts.end_to_end_timeout if timeouts_table.ok("end_to_end_timeout") else None
    pool_tables = root.children("pools", noun="pool")
    pools = _read_pools(pool_tables, input_cap)
    classes = _read_classes(
        root.children("classes", noun="class"), [name for name, _ in pool_tables], end_to_end
    )
    root.finish()
    if problems:
        raise ConfigError(problems, source=source)
    return Config(
        server=server,
        estimate=estimate,
        limits=limits,
        timeouts=timeouts,
        pools=pools,
        classes=classes,
        digest=hashlib.sha256(text.encode("utf-8")).hexdigest()[:16],
    )


# --------------------------------------------------------------------------
# Reading one table


class _Table:
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
        return _join(self.path, name)

    def has(self, name: str) -> bool:
        return name in self._data

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
            self.problem(name, f"must be {expect}, got {_describe(value)}")
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

    def string(self, name: str, default: str | None = None) -> str:
        def convert(value: object) -> str | None:
            return value if isinstance(value, str) else None

        return self._read(name, "a string", convert, default, "")

    def choice(self, name: str, options: tuple[_S, ...], default: _S | None = None) -> _S:
        expect = "one of " + ", ".join(json.dumps(option) for option in options)

        def convert(value: object) -> _S | None:
            return next((option for option in options if option == value), None)

        return self._read(name, expect, convert, default, options[0])

    def array(self, name: str, expect: str) -> list[object]:
        def convert(value: object) -> list[object] | None:
            return list(value) if isinstance(value, list) else None

        return self._read(name, expect, convert, None, [])

    def table(self, name: str) -> _Table:
        """An optional sub-table; an absent one reads as empty, so defaults apply."""
        data: Mapping[str, object] = self._read(name, "a table", _as_mapping, {}, {})
        return _Table(data, self.key(name), self._problems)

    def nested(self, key: str, value: object) -> _Table | None:
        """``value`` as a table at dotted ``key`` (an array item), or None if it is not one."""
        return _as_table(value, key, self._problems)

    def children(self, name: str, *, noun: str) -> list[tuple[str, _Table]]:
        """The required ``[name.NAME]`` tables, in file order, their names checked."""
        expect = f"a table with at least one [{name}.NAME] {noun}"

        def convert(value: object) -> Mapping[str, object] | None:
            return _as_mapping(value) or None  # an empty table is as bad as none

        data: Mapping[str, object] = self._read(name, expect, convert, None, {})
        parent = _Table(data, self.key(name), self._problems)
        children: list[tuple[str, _Table]] = []
        for child_name, value in parent._data.items():
            parent._known.add(child_name)
            child = parent.nested(parent.key(child_name), value)
            if child is None:
                parent.problem(child_name, f"must be a table (a {noun}), got {_describe(value)}")
                continue
            if not _NAME.fullmatch(child_name):
                parent.problem(child_name, f"{noun} name must match {_NAME.pattern}")
            children.append((child_name, child))
        return children


def _as_mapping(value: object) -> Mapping[str, object] | None:
    if not isinstance(value, dict):
        return None
    return {str(key): item for key, item in value.items()}


def _as_table(value: object, path: str, problems: list[str]) -> _Table | None:
    mapping = _as_mapping(value)
    return None if mapping is None else _Table(mapping, path, problems)


def _join(path: str, name: str) -> str:
    """``path.name``, with ``name`` quoted when it is not a bare TOML key."""
    part = name if _BARE_KEY.fullmatch(name) else json.dumps(name)
    return f"{path}.{part}" if path else part


def _describe(value: object) -> str:
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


# --------------------------------------------------------------------------
# Sections


def _read_server(table: _Table) -> ServerConfig:
    default = ServerConfig()
    http_host, http_port = _listen(table, "http_listen", default.http_host, default.http_port)
    grpc_host, grpc_port = _listen(table, "grpc_listen", default.grpc_host, default.grpc_port)
    max_body_bytes = table.integer("max_body_bytes", default.max_body_bytes, minimum=1)
    reload_poll_interval = table.number(
        "reload_poll_interval", default.reload_poll_interval, minimum=0.0, inclusive=True
    )
    table.finish()
    return ServerConfig(
        http_host=http_host,
        http_port=http_port,
        grpc_host=grpc_host,
        grpc_port=grpc_port,
        max_body_bytes=max_body_bytes,
        reload_poll_interval=reload_poll_interval,
    )


def _listen(table: _Table, name: str, host: str, port: int) -> tuple[str, int]:
    text = table.string(name, _host_port(host, port))
    if not table.ok(name):
        return host, port
    try:
        return _parse_listen(text)
    except ValueError as exc:
        table.problem(name, f"{exc}, got {json.dumps(text)}")
        return host, port


def _parse_listen(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); port 0 means any free port."""
    shape = 'must be "host:port" (IPv6 as "[::1]:8080")'
    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        raise ValueError(shape)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(f"{shape}; brackets are only for IPv6 addresses")
    elif ":" in host:
        raise ValueError(f'{shape}; put an IPv6 address in brackets')
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"{shape} with a port from 0 to 65535")
    return host, int(port_text)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _read_estimate(table: _Table) -> EstimateConfig:
    default = EstimateConfig()
    chars = table.number("chars_per_token", default.chars_per_token, minimum=0.0)
    cjk = table.number("cjk_chars_per_token", default.cjk_chars_per_token, minimum=0.0)
    per_message = table.integer("per_message_tokens", default.per_message_tokens, minimum=0)
    table.finish()
    return EstimateConfig(
        chars_per_token=chars, cjk_chars_per_token=cjk, per_message_tokens=per_message
    )


def _read_limits(table: _Table) -> LimitsConfig:
    default = LimitsConfig()
    input_cap = table.integer("input_cap_tokens", default.input_cap_tokens, minimum=1)
    default_max = table.integer("default_max_tokens", default.default_max_tokens, minimum=1)
    output_cap = table.integer("output_cap_tokens", default.output_cap_tokens, minimum=1)
    over_cap = table.choice("over_cap", _OVER_CAP_MODES, default.over_cap)
    if table.ok("default_max_tokens", "output_cap_tokens") and default_max > output_cap:
        table.problem(
            "default_max_tokens",
            f"{default_max} must be <= {table.key('output_cap_tokens')} {output_cap}"
            " (the default would be over the cap)",
        )
    table.finish()
    return LimitsConfig(
        input_cap_tokens=input_cap,
        default_max_tokens=default_max,
        output_cap_tokens=output_cap,
        over_cap=over_cap,
    )


def _read_timeouts(table: _Table) -> TimeoutsConfig:
    default = TimeoutsConfig()
    values = {
        name: table.number(name, getattr(default, name), minimum=0.0)
        for name in (
            "connect_timeout",
            "end_to_end_timeout",
            "health_check_interval",
            "health_check_timeout",
            "retry_after",
        )
    }
    table.finish()
    return TimeoutsConfig(**values)


def _read_pools(
    tables: Sequence[tuple[str, _Table]], input_cap: int | None
) -> tuple[PoolConfig, ...]:
    """The pools that read cleanly; an endpoint URL may appear only once overall."""
    used_urls: dict[str, str] = {}
    pools = (_read_pool(name, table, input_cap, used_urls) for name, table in tables)
    return tuple(pool for pool in pools if pool is not None)


def _read_pool(
    name: str,
    table: _Table,
    input_cap: int | None,
    used_urls: dict[str, str],
) -> PoolConfig | None:
    endpoints = _read_endpoints(table, used_urls)
    max_concurrency = table.integer("max_concurrency", minimum=1)
    max_queue = table.integer("max_queue", minimum=0)
    max_model_len = table.integer("max_model_len", minimum=1)
    models = _read_models(table)
    profile = table.choice("simulate_profile", _SIMULATE_PROFILES, PoolConfig.simulate_profile)
    if endpoints and table.ok("endpoints", "max_concurrency"):
        total = sum(endpoint.max_concurrency for endpoint in endpoints)
        if max_concurrency > total:
            table.problem(
                "max_concurrency",
                f"{max_concurrency} is more than its endpoints can take"
                f" (their max_concurrency adds up to {total}); the pool could never use it",
            )
    if input_cap is not None and table.ok("max_model_len") and max_model_len <= input_cap:
        table.problem(
            "max_model_len",
            f"{max_model_len} cannot hold a prompt of limits.input_cap_tokens {input_cap}"
            f" plus one output token (needs >= {input_cap + 1})",
        )
    if not table.finish():
        return None
    return PoolConfig(
        name=name,
        endpoints=endpoints,
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        max_model_len=max_model_len,
        models=models,
        simulate_profile=profile,
    )


def _read_endpoints(
    pool: _Table, used_urls: dict[str, str]
) -> tuple[EndpointConfig, ...]:
    """The pool's endpoints; an empty list is allowed (a pool being emptied for a move)."""
    items = pool.array("endpoints", 'an array of { url = "http://host:port", max_concurrency = N }')
    endpoints: list[EndpointConfig] = []
    for index, item in enumerate(items):
        key = f"{pool.key('endpoints')}[{index}]"
        table = pool.nested(key, item)
        if table is None:
            pool.report(key, f"must be a table, got {_describe(item)}")
            pool.invalidate("endpoints")
            continue
        url = _read_url(table, used_urls)
        max_concurrency = table.integer("max_concurrency", minimum=1)
        if table.finish():
            endpoints.append(EndpointConfig(url=url, max_concurrency=max_concurrency))
        else:
            pool.invalidate("endpoints")
    return tuple(endpoints)


def _read_url(table: _Table, used_urls: dict[str, str]) -> str:
    text = table.string("url")
    if not table.ok("url"):
        return text
    try:
        url = _normalise_url(text)
    except ValueError as exc:
        table.problem("url", f"{exc}, got {json.dumps(text)}")
        return text
    first = used_urls.setdefault(url, table.key("url"))
    if first != table.key("url"):
        table.problem("url", f"{url} is already {first}; an endpoint belongs to one pool, once")
    return url


def _normalise_url(text: str) -> str:
    """The one spelling of a server's base URL: ``scheme://host:port``, lower case.

    One spelling per server makes duplicates visible here and lets a reload
    match an endpoint of the old map to the same one in the new map by URL.
    """
    shape = 'must be a base URL "http(s)://host[:port]" with no path (not even /v1)'
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{shape}; {exc}") from None
    scheme = parts.scheme.lower()
    if (
        scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or parts.path not in ("", "/")
        or "?" in text
        or "#" in text
        or parts.username is not None
        or port == 0
    ):
        raise ValueError(shape)
    host = parts.hostname  # already lower case
    return f"{scheme}://{_host_port(host, port or _DEFAULT_PORTS[scheme])}"


def _read_models(pool: _Table) -> tuple[str, ...]:
    expect = "a non-empty array of served model names"
    items = pool.array("models", expect)
    if not pool.ok("models"):
        return ()
    if not items:
        pool.problem("models", f"must be {expect}, got an empty array")
    models: list[str] = []
    for index, item in enumerate(items):
        if isinstance(item, str) and item:
            models.append(item)
        else:
            key = f"{pool.key('models')}[{index}]"
            pool.report(key, f"must be a non-empty string, got {_describe(item)}")
    return tuple(models)


def _read_classes(
    tables: Sequence[tuple[str, _Table]],
    pool_names: Collection[str],
    end_to_end: float | None,
) -> tuple[ClassConfig, ...]:
    """The classes in file order (the match order), checked to cover every request."""
    catch_all: str | None = None
    for index, (name, table) in enumerate(tables):
        key = table.path
        is_catch_all = not table.has("max_prompt_tokens") and not table.has("max_output_tokens")
        if catch_all is not None:
            table.report(
                key, f"unreachable: {catch_all} before it has no thresholds and takes every request"
            )
        elif is_catch_all:
            catch_all = key
        elif index == len(tables) - 1:
            table.report(
                key,
                "the last class must be a catch-all (no max_prompt_tokens, no max_output_tokens),"
                " or a request over its thresholds would fit no class",
            )
    classes = (_read_class(name, table, pool_names, end_to_end) for name, table in tables)
    return tuple(klass for klass in classes if klass is not None)


def _read_class(
    name: str, table: _Table, pool_names: Collection[str], end_to_end: float | None
) -> ClassConfig | None:
    pool = table.string("pool")
    if table.ok("pool") and pool not in pool_names:
        defined = ", ".join(json.dumps(pool_name) for pool_name in pool_names) or "none"
        table.problem("pool", f"names no defined pool: {json.dumps(pool)} (defined: {defined})")
    max_prompt = table.optional_integer("max_prompt_tokens", minimum=1)
    max_output = table.optional_integer("max_output_tokens", minimum=1)
    queue_timeout = table.number("queue_timeout", minimum=0.0)
    if end_to_end is not None and table.ok("queue_timeout") and queue_timeout >= end_to_end:
        table.problem(
            "queue_timeout",
            f"{queue_timeout:g} s must be less than timeouts.end_to_end_timeout {end_to_end:g} s"
            " (the timeouts are layers: a request must have time left to run after it leaves"
            " the queue)",
        )
    priority = table.integer("priority")
    if not table.finish():
        return None
    return ClassConfig(
        name=name,
        pool=pool,
        queue_timeout=queue_timeout,
        priority=priority,
        max_prompt_tokens=max_prompt,
        max_output_tokens=max_output,
    )


# --------------------------------------------------------------------------
# Showing the configuration


def render_config(config: Config) -> str:
    """The effective settings, defaults filled in, for ``tailguard check-config``.

    Every value is shown, including those the file left out, under the same
    key names as ``config.toml``, so an operator sees what the process will do.
    """
    server, estimate = config.server, config.estimate
    limits, timeouts = config.limits, config.timeouts
    lines = [f"tailguard configuration, digest {config.digest or '(none)'}", ""]
    lines += _section("server", [
        ("http_listen", _host_port(server.http_host, server.http_port)),
        ("grpc_listen", _host_port(server.grpc_host, server.grpc_port)),
        ("max_body_bytes", f"{server.max_body_bytes} ({server.max_body_bytes / 2**20:g} MiB)"),
        ("reload_poll_interval",
         _seconds(server.reload_poll_interval) if server.reload_poll_interval else "off"),
    ])
    lines += _section("estimate", [
        ("chars_per_token", f"{estimate.chars_per_token:g}"),
        ("cjk_chars_per_token", f"{estimate.cjk_chars_per_token:g}"),
        ("per_message_tokens", str(estimate.per_message_tokens)),
    ])
    lines += _section("limits", [
        ("input_cap_tokens", str(limits.input_cap_tokens)),
        ("default_max_tokens", str(limits.default_max_tokens)),
        ("output_cap_tokens", f"{limits.output_cap_tokens} (over the cap: {limits.over_cap})"),
    ])
    lines += _section("timeouts", [
        ("connect_timeout", _seconds(timeouts.connect_timeout)),
        ("end_to_end_timeout", _seconds(timeouts.end_to_end_timeout)),
        ("health_check_interval", _seconds(timeouts.health_check_interval)),
        ("health_check_timeout", _seconds(timeouts.health_check_timeout)),
        ("retry_after", _seconds(timeouts.retry_after)),
    ])
    for pool in config.pools:
        lines += _render_pool(pool)
    lines.append("classes (the first that admits a request wins)")
    rows = [("name", "max_prompt_tokens", "max_output_tokens", "pool", "queue_timeout", "priority")]
    rows += [
        (klass.name, _threshold(klass.max_prompt_tokens), _threshold(klass.max_output_tokens),
         klass.pool, _seconds(klass.queue_timeout), str(klass.priority))
        for klass in config.classes
    ]
    lines += _aligned(rows, indent="  ")
    return "\n".join(lines) + "\n"


def _render_pool(pool: PoolConfig) -> list[str]:
    total = sum(endpoint.max_concurrency for endpoint in pool.endpoints)
    endpoints = _aligned(
        [(point.url, f"max_concurrency {point.max_concurrency}") for point in pool.endpoints],
        indent="",
    ) or ["(none: the pool has no GPUs now)"]
    pairs = [
        ("max_concurrency", f"{pool.max_concurrency} (endpoints' sum {total})"),
        ("max_queue", str(pool.max_queue)),
        ("max_model_len", str(pool.max_model_len)),
        ("models", ", ".join(pool.models)),
        ("simulate_profile", pool.simulate_profile),
        ("endpoints", endpoints[0]),
        *(("", line) for line in endpoints[1:]),
    ]
    return _section(f"pool {pool.name}", pairs)


def _section(title: str, pairs: Sequence[tuple[str, str]]) -> list[str]:
    return [title, *_aligned(pairs, indent="  "), ""]


def _aligned(rows: Sequence[Sequence[str]], *, indent: str) -> list[str]:
    """Rows of cells as lines, each column padded to its widest cell."""
    if not rows:
        return []
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        (indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths))).rstrip()
        for row in rows
    ]


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _threshold(value: int | None) -> str:
    return "any" if value is None else f"<= {value}"


def limits_document(config: Config) -> dict[str, object]:
    """What callers may send and how they will be classified: ``GET /v1/limits``.

    Callers size their requests from this (and learn that ``max_tokens`` must be
    set to land in a fast class); endpoint URLs are internal and left out.
    """
    limits, estimate = config.limits, config.estimate
    return {
        "input_cap_tokens": limits.input_cap_tokens,
        "default_max_tokens": limits.default_max_tokens,
        "output_cap_tokens": limits.output_cap_tokens,
        "over_cap": limits.over_cap,
        "estimate": {
            "chars_per_token": estimate.chars_per_token,
            "cjk_chars_per_token": estimate.cjk_chars_per_token,
            "per_message_tokens": estimate.per_message_tokens,
        },
        "end_to_end_timeout": config.timeouts.end_to_end_timeout,
        "classes": [
            {
                "name": klass.name,
                "max_prompt_tokens": klass.max_prompt_tokens,
                "max_output_tokens": klass.max_output_tokens,
                "queue_timeout": klass.queue_timeout,
                "priority": klass.priority,
                "pool": klass.pool,
            }
            for klass in config.classes
        ],
        "pools": [
            {"name": pool.name, "max_model_len": pool.max_model_len, "models": list(pool.models)}
            for pool in config.pools
        ],
    }
