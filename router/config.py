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
import ipaddress
import json
import math
import os
import re
import ssl
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar, get_args
from urllib.parse import urlsplit

import tomli

from .auth import hash_key
from .config_types import (
    ApiKeyConfig,
    AuthConfig,
    BackendAccess,
    ClassConfig,
    ClusterConfig,
    Config,
    DiscoveryConfig,
    DnsEndpointsConfig,
    DnsScheme,
    EndpointConfig,
    EstimateConfig,
    HealthCheckKind,
    HttpServerKind,
    LendConfig,
    LimitsConfig,
    LogFormat,
    LoggingConfig,
    LogLevel,
    MetricsConfig,
    OutlierDetectionConfig,
    OverCapMode,
    PoolConfig,
    RebalanceConfig,
    RebalanceMode,
    ServerConfig,
    SimulateProfile,
    TimeoutsConfig,
    TlsConfig,
    TracingConfig,
)
from .tls import TlsFileError
from .tls import checked as checked_tls

__all__ = ["ConfigError", "limits_document", "load_config", "max_model_len_problem", "parse_config", "render_config"]

_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# A class's relay_interval above this would show as a stalled stream, not as tokens in bursts.
_MAX_RELAY_INTERVAL = 1.0
# A pool's max_queue left out: this many waiting requests per seat. Deeper, and
# a request near the back would mostly wait out its class's queue_timeout
# (fail_fast_fraction refuses those sooner anyway); the shipped interactive
# pool's 256 for 64 seats.
_QUEUE_PER_SEAT = 4
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_OVER_CAP_MODES: tuple[OverCapMode, ...] = get_args(OverCapMode)
_SIMULATE_PROFILES: tuple[SimulateProfile, ...] = get_args(SimulateProfile)
_LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
_LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
_HEALTH_CHECKS: tuple[HealthCheckKind, ...] = get_args(HealthCheckKind)
_REBALANCE_MODES: tuple[RebalanceMode, ...] = get_args(RebalanceMode)
_HTTP_SERVERS: tuple[HttpServerKind, ...] = get_args(HttpServerKind)
_DNS_SCHEMES: tuple[DnsScheme, ...] = get_args(DnsScheme)
_DNS_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


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


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Read and validate the configuration file at ``path``.

    ``environ`` (default ``os.environ``) resolves ``key_env`` and
    ``keys_file_env``, as in :func:`parse_config`. Raises :exc:`ConfigError`
    if the file cannot be read, is not UTF-8 TOML, or fails validation.
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
    return parse_config(text, source=source, environ=environ)


def parse_config(
    text: str, *, source: str = "<string>", environ: Mapping[str, str] | None = None
) -> Config:
    """Parse and validate TOML ``text``; ``source`` names it in error messages.

    API keys named by environment variable (``key_env``) and the keys file
    (``keys_file_env``) are resolved now, from ``environ`` (default
    ``os.environ``), so a missing secret stops the load rather than a request.
    Raises :exc:`ConfigError` listing every problem found; no problem quotes a
    key or a value that might be one.
    """
    environ = os.environ if environ is None else environ
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
    pools = _read_pools(pool_tables, input_cap, environ)
    class_tables = root.children("classes", noun="class")
    classes = _read_classes(class_tables, [name for name, _ in pool_tables], end_to_end)
    _check_pool_references(pools, classes, dict(pool_tables))
    auth_table = root.table("auth")
    auth = _read_auth(
        auth_table,
        present=root.has("auth") and root.ok("auth"),
        class_names=[name for name, _ in class_tables],
        environ=environ,
    )
    logging_config = _read_logging(root.table("logging"))
    metrics = _read_metrics(root.table("metrics"))
    rebalance = _read_rebalance(root.table("rebalance"))
    cluster = _read_cluster(root.table("cluster"), present=root.has("cluster"))
    discovery = _read_discovery(root.table("discovery"))
    tracing = _read_tracing(root.table("tracing"))
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
        digest=_digest(text, auth, pools),
        auth=auth,
        logging=logging_config,
        metrics=metrics,
        rebalance=rebalance,
        cluster=cluster,
        discovery=discovery,
        tracing=tracing,
        warnings=_warnings(timeouts),
    )


def _digest(text: str, auth: AuthConfig, pools: Sequence[PoolConfig] = ()) -> str:
    """A short hash of the text and of the keys it resolved from outside itself.

    The keys go in as their digests, names and rights (never a key, and not the
    keys file's text), so rotating a key in the keys file or the environment
    changes the digest and a reload applies it; the backend keys
    (``api_key_env``) likewise, as their digests. Without either this is the
    hash of the text alone.
    """
    digest = hashlib.sha256(text.encode("utf-8"))
    for key in auth.keys:
        classes = ",".join(sorted(key.may_force_classes))
        digest.update(f"\0{key.name}\0{key.sha256}\0{classes}\0{key.max_concurrency}".encode())
    for pool in pools:
        for access in {pool.access, *(e.access for e in pool.endpoints), *(s.access for s in pool.endpoints_dns)}:
            if access.api_key is not None:
                digest.update(f"\0{pool.name}\0{access.api_key_env}\0{hash_key(access.api_key)}".encode())
    return digest.hexdigest()[:16]


def _warnings(timeouts: TimeoutsConfig) -> tuple[str, ...]:
    """Settings that tailguard can run with but that will hurt, and what to change."""
    warnings: list[str] = []
    front, end_to_end = timeouts.front_proxy_timeout, timeouts.end_to_end_timeout
    if front is not None and front <= end_to_end:
        warnings.append(
            f"timeouts.front_proxy_timeout ({front:g} s) is not above"
            f" timeouts.end_to_end_timeout ({end_to_end:g} s): the proxy in front would cut off"
            " requests tailguard is still serving (and hide its 504); raise the proxy's read"
            f" timeout (nginx proxy_read_timeout) above {end_to_end:g} s"
        )
    return tuple(warnings)


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
        self.problem(name, f"must be a string, got {_kind(value)} (its value is not shown)")
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

    def tables_in(self, name: str, expect: str, default: list[object] | None = None) -> list[_Table]:
        """The tables of array ``name``; an item that is not a table is reported, skipped, and marks ``name`` bad."""
        tables: list[_Table] = []
        for index, item in enumerate(self.array(name, expect, default)):
            key = f"{self.key(name)}[{index}]"
            table = self.nested(key, item)
            if table is None:
                self.report(key, f"must be a table, got {_describe(item)}")
                self.invalidate(name)
                continue
            tables.append(table)
        return tables

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


def _kind(value: object) -> str:
    """A value's TOML type without the value, for what may be a secret."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, (dict, list)):
        return _describe(value)
    return "a date or time"


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
    grpc_max_calls = table.integer("grpc_max_calls", default.grpc_max_calls, minimum=1)
    max_backend_body_bytes = table.integer(
        "max_backend_body_bytes", default.max_backend_body_bytes, minimum=1024
    )
    reload_poll_interval = table.number(
        "reload_poll_interval", default.reload_poll_interval, minimum=0.0, inclusive=True
    )
    http_server = table.choice("http_server", _HTTP_SERVERS, default.http_server)
    max_header_bytes = table.integer("max_header_bytes", default.max_header_bytes, minimum=1024)
    header_timeout = table.number("header_timeout", default.header_timeout, minimum=0.0)
    body_timeout = table.number("body_timeout", default.body_timeout, minimum=0.0)
    keep_alive_timeout = table.number("keep_alive_timeout", default.keep_alive_timeout, minimum=0.0)
    write_timeout = table.number("write_timeout", default.write_timeout, minimum=0.0)
    max_connections = table.integer("max_connections", default.max_connections, minimum=1)
    workers = table.integer("workers", default.workers, minimum=1)
    http_tls = _read_tls(table, "http_tls")
    grpc_tls = _read_tls(table, "grpc_tls")
    if http_tls is not None and http_server == "hypercorn":
        table.problem("http_tls", 'TLS is served by tailguard\'s own HTTP server: needs server.http_server = "lean"')
    table.finish()
    return ServerConfig(
        http_host=http_host,
        http_port=http_port,
        grpc_host=grpc_host,
        grpc_port=grpc_port,
        max_body_bytes=max_body_bytes,
        grpc_max_calls=grpc_max_calls,
        max_backend_body_bytes=max_backend_body_bytes,
        reload_poll_interval=reload_poll_interval,
        http_server=http_server,
        max_header_bytes=max_header_bytes,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        keep_alive_timeout=keep_alive_timeout,
        write_timeout=write_timeout,
        max_connections=max_connections,
        workers=workers,
        http_tls=http_tls,
        grpc_tls=grpc_tls,
    )


def _read_tls(server: _Table, name: str) -> TlsConfig | None:
    """``[server.NAME]``: a listener's certificate, key and optional client CA, loaded now.

    Absent: the listener is plain TCP. A file that cannot serve (missing, not
    PEM, a key that is not the certificate's) is a problem under its own key.
    """
    present = server.has(name)
    table = server.table(name)
    if not present:
        return None
    cert_file = table.string("cert_file")
    key_file = table.string("key_file")
    client_ca_file = table.optional_string("client_ca_file")
    table.finish()
    if not (server.ok(name) and table.ok("cert_file", "key_file", "client_ca_file")):
        return None
    try:
        return checked_tls(TlsConfig(cert_file, key_file, client_ca_file))
    except TlsFileError as error:
        table.problem(error.key, error.message)
        return None


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
            "backend_keep_alive_timeout",
            "end_to_end_timeout",
            "health_check_interval",
            "health_check_timeout",
            "retry_after",
        )
    }
    front_proxy = table.optional_number("front_proxy_timeout", minimum=0.0)
    drain = table.number("drain_timeout", default.drain_timeout, minimum=0.0, inclusive=True)
    table.finish()
    return TimeoutsConfig(**values, front_proxy_timeout=front_proxy, drain_timeout=drain)


def _read_logging(table: _Table) -> LoggingConfig:
    default = LoggingConfig()
    written = table.string("level", default.level)
    level = next((name for name in _LOG_LEVELS if name == written.upper()), default.level)
    if table.ok("level") and written.upper() not in _LOG_LEVELS:
        names = ", ".join(json.dumps(name) for name in _LOG_LEVELS)
        table.problem("level", f"must be one of {names} (any case), got {json.dumps(written)}")
    log_format = table.choice("format", _LOG_FORMATS, default.format)
    access_log = table.boolean("access_log", default.access_log)
    log_prompts = table.boolean("log_prompts", default.log_prompts)
    table.finish()
    return LoggingConfig(
        level=level, format=log_format, access_log=access_log, log_prompts=log_prompts
    )


def _read_metrics(table: _Table) -> MetricsConfig:
    default = MetricsConfig()
    scrape = table.number(
        "backend_scrape_interval", default.backend_scrape_interval, minimum=0.0, inclusive=True
    )
    window = table.number(
        "duplicate_request_id_window",
        default.duplicate_request_id_window,
        minimum=0.0,
        inclusive=True,
    )
    table.finish()
    return MetricsConfig(backend_scrape_interval=scrape, duplicate_request_id_window=window)


def _read_cluster(table: _Table, present: bool) -> ClusterConfig | None:
    """``[cluster]``: absent, this process holds every cap alone (no Redis needed)."""
    if not present:
        table.finish()
        return None
    default = ClusterConfig(redis_url="")
    url = table.string("redis_url")
    if table.ok("redis_url") and not (url.startswith(("redis://", "rediss://", "unix://"))):
        table.problem("redis_url", f"must be a redis:// (or rediss://, unix://) URL, got {json.dumps(url)}")
    namespace = table.string("namespace", default.namespace)
    replica_id = table.string("replica_id", default.replica_id)
    ttl = table.number("lease_ttl", default.lease_ttl, minimum=0.0)
    interval = table.number("sync_interval", default.sync_interval, minimum=0.0)
    if table.ok("lease_ttl", "sync_interval") and interval * 3 > ttl:
        table.problem("sync_interval", f"{interval:g} s must be at most a third of {table.key('lease_ttl')} {ttl:g} s (a lease is renewed at every sync)")
    share = table.number("static_share", default.static_share, minimum=0.0, inclusive=True)
    if table.ok("static_share") and share > 1:
        table.problem("static_share", f"must be at most 1 (a share of each cap; the replicas' shares must add up to at most 1), got {share:g}")
    block = table.integer("block", default.block, minimum=0)
    table.finish()
    return ClusterConfig(
        redis_url=url, namespace=namespace, replica_id=replica_id, lease_ttl=ttl, sync_interval=interval, static_share=share, block=block
    )


def _read_rebalance(table: _Table) -> RebalanceConfig:
    default = RebalanceConfig()
    interval = table.number("interval", default.interval, minimum=0.0)
    hold = table.number("hold_time", default.hold_time, minimum=0.0, inclusive=True)
    threshold = table.number("threshold", default.threshold, minimum=0.0)
    cooldown = table.number("cooldown", default.cooldown, minimum=0.0, inclusive=True)
    if table.ok("interval", "hold_time") and hold < interval:
        table.problem("hold_time", f"{hold:g} s must be at least {table.key('interval')} {interval:g} s")
    table.finish()
    return RebalanceConfig(interval=interval, hold_time=hold, threshold=threshold, cooldown=cooldown)


def _read_pools(
    tables: Sequence[tuple[str, _Table]], input_cap: int | None, environ: Mapping[str, str]
) -> tuple[PoolConfig, ...]:
    """The pools that read cleanly; an endpoint URL may appear only once overall."""
    used_urls: dict[str, str] = {}
    used_names: dict[tuple[str, int, str], str] = {}
    pools = (_read_pool(name, table, input_cap, used_urls, used_names, environ) for name, table in tables)
    return tuple(pool for pool in pools if pool is not None)


def _read_pool(
    name: str,
    table: _Table,
    input_cap: int | None,
    used_urls: dict[str, str],
    used_names: dict[tuple[str, int, str], str],
    environ: Mapping[str, str],
) -> PoolConfig | None:
    access = _read_access(table, BackendAccess(), environ, pool=True)
    endpoints = _read_endpoints(table, used_urls, access, environ)
    endpoints_dns = _read_endpoints_dns(table, used_names, access, environ)
    max_concurrency = _read_pool_cap(table, endpoints)
    max_queue = table.integer("max_queue", _QUEUE_PER_SEAT * max_concurrency, minimum=0)
    max_model_len = table.optional_integer("max_model_len", minimum=1)  # None: asked of the endpoints
    models = _read_models(table)
    profile = table.choice("simulate_profile", _SIMULATE_PROFILES, PoolConfig.simulate_profile)
    fail_fast = table.number(
        "fail_fast_fraction", PoolConfig.fail_fast_fraction, minimum=0.0, inclusive=True
    )
    if table.ok("fail_fast_fraction") and fail_fast > 1:
        table.problem(
            "fail_fast_fraction",
            f"must be at most 1 (a fraction of the class's queue_timeout; 0 turns it off), got {fail_fast:g}",
        )
    first_byte = table.number("first_byte_timeout", PoolConfig.first_byte_timeout, minimum=0.0)
    health_check = table.choice("health_check", _HEALTH_CHECKS, PoolConfig.health_check)
    unhealthy_threshold = table.integer("unhealthy_threshold", PoolConfig.unhealthy_threshold, minimum=1)
    healthy_threshold = table.integer("healthy_threshold", PoolConfig.healthy_threshold, minimum=1)
    outlier = _read_outlier_detection(table.table("outlier_detection"))
    lend = _read_lend(table.table("lend"), name, max_concurrency if table.ok("max_concurrency") else None)
    class_limits = _read_class_limits(table)
    vllm_priority = table.boolean("vllm_priority", PoolConfig.vllm_priority)
    stream_upstream = table.boolean("stream_upstream", PoolConfig.stream_upstream)
    rebalance = table.choice("rebalance", _REBALANCE_MODES, PoolConfig.rebalance)
    if endpoints and not endpoints_dns and table.ok("endpoints", "endpoints_dns", "max_concurrency"):
        total = sum(endpoint.max_concurrency for endpoint in endpoints)
        if max_concurrency > total:
            table.problem(
                "max_concurrency",
                f"{max_concurrency} is more than its endpoints can take"
                f" (their max_concurrency adds up to {total}); the pool could never use it",
            )
    if input_cap is not None and max_model_len is not None and table.ok("max_model_len"):
        problem = max_model_len_problem(max_model_len, input_cap)
        if problem is not None:
            table.problem("max_model_len", problem)
    if not table.finish():
        return None
    return PoolConfig(
        name=name,
        endpoints=endpoints,
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        max_model_len=max_model_len or 0,
        models=models,
        simulate_profile=profile,
        fail_fast_fraction=fail_fast,
        first_byte_timeout=first_byte,
        health_check=health_check,
        unhealthy_threshold=unhealthy_threshold,
        healthy_threshold=healthy_threshold,
        outlier_detection=outlier,
        lend=lend,
        class_max_concurrency=class_limits,
        vllm_priority=vllm_priority,
        stream_upstream=stream_upstream,
        rebalance=rebalance,
        endpoints_dns=endpoints_dns,
        max_model_len_configured=max_model_len is not None,
        access=access,
    )


def _read_pool_cap(table: _Table, endpoints: Sequence[EndpointConfig]) -> int:
    """``max_concurrency``; left out, the sum of the endpoints' caps, which is all the pool can run.

    There is no such sum to default to with ``endpoints_dns`` (the number of
    addresses changes) or with no endpoints: the key is then required.
    """
    written = table.optional_integer("max_concurrency", minimum=1)
    if written is not None:
        return written
    if endpoints and not table.has("endpoints_dns") and table.ok("endpoints"):
        return sum(endpoint.max_concurrency for endpoint in endpoints)
    if not table.ok("endpoints", "endpoints_dns"):
        table.invalidate("max_concurrency")  # its default depends on what was reported there
    elif table.has("endpoints_dns"):
        table.problem("max_concurrency", "missing: must be an integer >= 1 (with endpoints_dns there is no fixed sum of caps to default to)")
    else:
        table.problem("max_concurrency", "missing: must be an integer >= 1 (the pool has no endpoints whose caps it could add up)")
    return 1


def max_model_len_problem(max_model_len: int, input_cap: int) -> str | None:
    """Why ``max_model_len`` cannot serve ``limits.input_cap_tokens``, or None (also checked on a discovered value)."""
    if max_model_len > input_cap:
        return None
    return (
        f"{max_model_len} cannot hold a prompt of limits.input_cap_tokens {input_cap}"
        f" plus one output token (needs >= {input_cap + 1})"
    )


def _read_endpoints_dns(
    pool: _Table, used_names: dict[tuple[str, int, str], str], access: BackendAccess, environ: Mapping[str, str]
) -> tuple[DnsEndpointsConfig, ...]:
    """``endpoints_dns``: names whose addresses are endpoints (router/discovery.py); one pool per name and port."""
    expect = 'an array of { name = "svc.namespace.svc.cluster.local", port = N, max_concurrency = N }'
    sources: list[DnsEndpointsConfig] = []
    for table in pool.tables_in("endpoints_dns", expect, []):
        name = table.string("name")
        if table.ok("name"):
            problem = _dns_name_problem(name)
            if problem is not None:
                table.problem("name", f"{problem}, got {json.dumps(name)}")
        port = table.integer("port", minimum=1)
        if table.ok("port") and port > 65535:
            table.problem("port", f"must be at most 65535, got {port}")
        scheme = table.choice("scheme", _DNS_SCHEMES, DnsEndpointsConfig.scheme)
        max_concurrency = table.integer("max_concurrency", minimum=1)
        own = _read_access(table, access, environ)
        source = DnsEndpointsConfig(name=name, port=port, max_concurrency=max_concurrency, scheme=scheme, access=own)
        if table.ok("name", "port", "scheme"):
            first = used_names.setdefault(source.key, table.key("name"))
            if first != table.key("name"):
                table.problem("name", f"{name} port {port} is already {first}; its addresses belong to one pool, once")
        if table.finish():
            sources.append(source)
        else:
            pool.invalidate("endpoints_dns")
    return tuple(sources)


def _dns_name_problem(name: str) -> str | None:
    """Why ``name`` is not a host name to resolve, or None (an address belongs in ``endpoints``)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return "must be a DNS name, not an address (a fixed address is an entry of endpoints)"
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    if len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return "must be a DNS name (dot-separated labels of letters, digits, '-' and '_', 63 at most each)"
    return None


def _read_discovery(table: _Table) -> DiscoveryConfig:
    """``[discovery]``: how often and through which server ``endpoints_dns`` are resolved."""
    default = DiscoveryConfig()
    interval = table.number("interval", default.interval, minimum=0.0)
    timeout = table.number("timeout", default.timeout, minimum=0.0)
    text = table.optional_string("nameserver")
    host, port = None, default.nameserver_port
    if text is not None and table.ok("nameserver"):
        try:
            host, port = _nameserver(text)
        except ValueError:
            table.problem("nameserver", f'must be an IP address with an optional port ("10.96.0.10", "127.0.0.1:5353", "[::1]:53"), got {json.dumps(text)}')
    table.finish()
    return DiscoveryConfig(interval=interval, timeout=timeout, nameserver=host, nameserver_port=port)


def _read_tracing(table: _Table) -> TracingConfig:
    """``[tracing]``: where spans go and how many traces are kept (router/tracing.py makes them)."""
    default = TracingConfig()
    enabled = table.boolean("enabled", default.enabled)
    endpoint = table.string("endpoint", default.endpoint)
    if table.ok("endpoint"):
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            table.problem("endpoint", f'must be an http:// or https:// URL (OTLP/HTTP, e.g. "http://127.0.0.1:4318/v1/traces"), got {json.dumps(endpoint)}')
    ratio = table.number("sample_ratio", default.sample_ratio, minimum=0.0, inclusive=True)
    if table.ok("sample_ratio") and ratio > 1:
        table.problem("sample_ratio", f"must be at most 1 (the share of traces kept), got {ratio:g}")
    service_name = table.string("service_name", default.service_name)
    if table.ok("service_name") and not service_name.strip():
        table.problem("service_name", "must not be empty")
    headers: list[tuple[str, str]] = []
    written: Mapping[str, object] = table._read("headers", "a table of header names to strings", _as_mapping, {}, {})
    for name, value in written.items():
        key = _join(table.key("headers"), name)
        if not _HEADER_NAME.fullmatch(name):
            table.report(key, "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
            table.invalidate("headers")
        elif not isinstance(value, str):  # the value may be a credential: never quoted
            table.report(key, f"must be a string, got {_kind(value)} (its value is not shown)")
            table.invalidate("headers")
        elif _HEADER_VALUE.fullmatch(value) is None:
            table.report(key, "must be printable ASCII: it holds another character (its value is not shown)")
            table.invalidate("headers")
        else:
            headers.append((name.lower(), value))
    table.finish()
    return TracingConfig(enabled=enabled, endpoint=endpoint, sample_ratio=ratio, service_name=service_name, headers=tuple(headers))


def _nameserver(text: str) -> tuple[str, int]:
    """(address, port) of ``ADDRESS``, ``ADDRESS:PORT`` or ``[IPV6]:PORT``; raises ValueError."""
    try:
        return ipaddress.ip_address(text).compressed, 53  # a bare address, IPv6 included
    except ValueError:
        pass
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(text)  # IPv6 with a port needs brackets
    return ipaddress.ip_address(host).compressed, int(port)


def _read_lend(table: _Table, pool: str, max_concurrency: int | None) -> LendConfig:
    """``[pools.NAME.lend]``; which pools it names is checked once all are read."""
    names = table.array("to", "an array of pool names", [])
    to: list[str] = []
    for name in names:
        if not isinstance(name, str):
            table.problem("to", f"must hold pool names (strings), got {_describe(name)}")
        elif name == pool:
            table.problem("to", f"a pool cannot lend to itself ({json.dumps(name)})")
        elif name not in to:
            to.append(name)
    max_seats = table.optional_integer("max_seats", minimum=1)
    reserve = table.integer("reserve", LendConfig.reserve, minimum=0)
    if max_concurrency is not None and table.ok("reserve") and reserve >= max_concurrency and to:
        table.problem("reserve", f"{reserve} leaves nothing to lend of the pool's max_concurrency {max_concurrency}")
    max_prompt = table.optional_integer("max_prompt_tokens", minimum=1)
    max_output = table.optional_integer("max_output_tokens", minimum=1)
    table.finish()
    return LendConfig(
        to=tuple(to), max_seats=max_seats, reserve=reserve, max_prompt_tokens=max_prompt, max_output_tokens=max_output
    )


def _read_class_limits(pool: _Table) -> tuple[tuple[str, int], ...]:
    """``class_max_concurrency = { CLASS = SEATS, ... }``; the class names are checked later."""
    if not pool.has("class_max_concurrency"):
        return ()
    table = pool.table("class_max_concurrency")
    limits = []
    for name in table.names():
        seats = table.integer(name, minimum=1)
        if table.ok(name):
            limits.append((name, seats))
    table.finish()
    return tuple(limits)


def _check_pool_references(
    pools: Sequence[PoolConfig], classes: Sequence[ClassConfig], pool_tables: Mapping[str, _Table]
) -> None:
    """Pools' ``lend.to`` must name pools, and ``class_max_concurrency`` classes routed there or lent to."""
    pool_names = [pool.name for pool in pools]
    class_names = [klass.name for klass in classes]
    for pool in pools:
        table = pool_tables[pool.name]
        for name in pool.lend.to:
            if name not in pool_names:
                table.report(table.key("lend") + ".to", f"names no defined pool: {json.dumps(name)}")
        for name, _ in pool.class_max_concurrency:
            if name not in class_names:
                defined = ", ".join(json.dumps(c) for c in class_names)
                table.report(table.key("class_max_concurrency"), f"names no defined class: {json.dumps(name)} (defined: {defined})")


def _read_outlier_detection(table: _Table) -> OutlierDetectionConfig:
    default = OutlierDetectionConfig()
    # One failure is never enough: a single request can fail on its own account.
    consecutive = table.integer("consecutive_failures", default.consecutive_failures, minimum=2)
    base = table.number("base_ejection_time", default.base_ejection_time, minimum=0.0)
    longest = table.number("max_ejection_time", default.max_ejection_time, minimum=0.0)
    percent = table.number(
        "max_ejection_percent", default.max_ejection_percent, minimum=0.0, inclusive=True
    )
    if table.ok("max_ejection_percent") and percent > 100:
        table.problem("max_ejection_percent", f"must be at most 100, got {percent:g}")
    ratio = table.number("failure_ratio", default.failure_ratio, minimum=0.0, inclusive=True)
    if table.ok("failure_ratio") and ratio > 1:
        table.problem("failure_ratio", f"must be at most 1 (a share of requests; 0 turns the rule off), got {ratio:g}")
    window = table.integer("failure_window", default.failure_window, minimum=1)
    least = table.integer("failure_min_requests", default.failure_min_requests, minimum=1)
    if table.ok("failure_window", "failure_min_requests") and least > window:
        table.problem("failure_min_requests", f"{least} must be <= {table.key('failure_window')} {window}")
    if table.ok("base_ejection_time", "max_ejection_time") and longest < base:
        table.problem(
            "max_ejection_time",
            f"{longest:g} must be >= {table.key('base_ejection_time')} {base:g}",
        )
    table.finish()
    return OutlierDetectionConfig(
        consecutive_failures=consecutive,
        base_ejection_time=base,
        max_ejection_time=longest,
        max_ejection_percent=percent,
        failure_ratio=ratio,
        failure_window=window,
        failure_min_requests=least,
    )


def _read_access(table: _Table, inherited: BackendAccess, environ: Mapping[str, str], *, pool: bool = False) -> BackendAccess:
    """``api_key_env`` (and, on a ``pool``, ``tls_ca_file``): tailguard's own credentials for the engines.

    An endpoint entry's ``api_key_env`` overrides its pool's. The variable
    is read now, so a missing secret refuses the file (check-config names
    the variable) instead of failing every request with the engine's 401.
    """
    api_key_env, api_key = inherited.api_key_env, inherited.api_key
    if table.has("api_key_env"):
        name = table.string("api_key_env")
        api_key_env, api_key = name, None
        if table.ok("api_key_env"):
            if not _ENV_NAME.fullmatch(name):
                table.problem("api_key_env", f"must be the name of an environment variable ({_ENV_NAME.pattern}), got {json.dumps(name)}")
            elif (value := environ.get(name)) is None:
                table.problem(
                    "api_key_env",
                    f"environment variable {name} is not set (it holds the key tailguard sends to these engines,"
                    " as vLLM's --api-key)",
                )
            else:
                api_key = value.strip()  # a trailing newline in a secret store is a classic
                if not api_key or not all("!" <= char <= "~" for char in api_key):
                    table.problem(
                        "api_key_env",
                        f"environment variable {name} is empty or holds characters an Authorization header"
                        " cannot carry (printable ASCII without spaces only)",
                    )
    tls_ca_file = inherited.tls_ca_file
    if pool and table.has("tls_ca_file"):
        tls_ca_file = table.string("tls_ca_file")
        if table.ok("tls_ca_file"):
            try:
                ssl.create_default_context(cafile=tls_ca_file)
            except (OSError, ssl.SSLError) as exc:
                table.problem("tls_ca_file", f"cannot load {json.dumps(tls_ca_file)} as PEM certificates: {exc}")
    return BackendAccess(api_key_env=api_key_env, api_key=api_key, tls_ca_file=tls_ca_file)


def _read_endpoints(
    pool: _Table, used_urls: dict[str, str], access: BackendAccess, environ: Mapping[str, str]
) -> tuple[EndpointConfig, ...]:
    """The pool's endpoints; an empty list is allowed (a pool being emptied for a move), none at all beside endpoints_dns."""
    expect = 'an array of { url = "http://host:port", max_concurrency = N }'
    endpoints: list[EndpointConfig] = []
    for table in pool.tables_in("endpoints", expect, [] if pool.has("endpoints_dns") else None):
        url = _read_url(table, used_urls)
        max_concurrency = table.integer("max_concurrency", minimum=1)
        movable = table.boolean("movable", EndpointConfig.movable)
        own = _read_access(table, access, environ)
        if table.finish():
            endpoints.append(EndpointConfig(url=url, max_concurrency=max_concurrency, movable=movable, access=own))
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
    for index, (_name, table) in enumerate(tables):
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
    classes = (_read_class(name, table, pool_names, end_to_end, index) for index, (name, table) in enumerate(tables))
    return tuple(klass for klass in classes if klass is not None)


def _read_class(
    name: str, table: _Table, pool_names: Collection[str], end_to_end: float | None, index: int
) -> ClassConfig | None:
    """One class; ``priority`` left out is ``index``, its place in file order.

    Classes match in file order, the narrowest first and the catch-all last,
    so that order already ranks short requests ahead of long ones; a shared
    default (0 for all) would make a queue that classes share first come,
    first served, which is what tailguard is there to prevent.
    """
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
    priority = table.integer("priority", index)
    relay_interval = table.number("relay_interval", 0.0, minimum=0.0, inclusive=True)
    if table.ok("relay_interval") and relay_interval > _MAX_RELAY_INTERVAL:
        table.problem("relay_interval", f"{relay_interval:g} s is over {_MAX_RELAY_INTERVAL:g} s: a stream would stall visibly")
    if not table.finish():
        return None
    return ClassConfig(
        name=name,
        pool=pool,
        queue_timeout=queue_timeout,
        priority=priority,
        max_prompt_tokens=max_prompt,
        max_output_tokens=max_output,
        relay_interval=relay_interval,
    )


# --------------------------------------------------------------------------
# API keys
#
# A key reaches the router as a digest (key_sha256), through an environment
# variable (key_env), or in plaintext (key) from the keys file, which is the
# secret store; config.toml may not hold a plaintext key. Whatever the route,
# only the digest is kept, and no problem quotes a value that may be a key.

# A key read cleanly: its table (to report a clash on), the key that gave it.
_KeyEntry = tuple[_Table, str, ApiKeyConfig]


def _read_auth(
    table: _Table,
    *,
    present: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> AuthConfig:
    """The keys of config.toml, then those of the keys file, all checked unique.

    An ``[auth]`` table that ends up with no key is refused rather than read as
    "auth off": an empty keys file must not open the router by accident.
    """
    variable = table.optional_string("keys_file_env")
    entries = _read_keys(table, in_keys_file=False, class_names=class_names, environ=environ)
    keys_file: str | None = None
    file_problems: list[str] = []
    if variable is not None and table.ok("keys_file_env"):
        keys_file = _keys_file_path(table, variable, environ)
        if keys_file is not None:
            file_root = _read_keys_file(table, keys_file, variable, file_problems)
            if file_root is not None:
                entries += _read_keys(
                    file_root, in_keys_file=True, class_names=class_names, environ=environ
                )
                file_root.finish()
    _check_unique(entries)
    for problem in file_problems:  # after _check_unique, which may add to them
        table.report(table.key("keys_file_env"), f"in the keys file {keys_file}: {problem}")
    if table.finish() and present and not entries:
        where = "in [[auth.keys]]" + (f" or in the keys file {keys_file}" if keys_file else "")
        table.report(
            table.path,
            f"no API key {where}: delete [auth] to run without authentication, or add a key",
        )
    return AuthConfig(keys=tuple(key for _, _, key in entries), keys_file=keys_file)


def _keys_file_path(auth: _Table, variable: str, environ: Mapping[str, str]) -> str | None:
    if not _ENV_NAME.fullmatch(variable):
        auth.problem(
            "keys_file_env", f"must be the name of an environment variable ({_ENV_NAME.pattern})"
        )
        return None
    path = environ.get(variable)
    if not path:
        state = "is not set" if path is None else "is empty"
        auth.problem(
            "keys_file_env",
            f"environment variable {variable} {state} (it should hold the keys file's path)",
        )
        return None
    return path


def _read_keys_file(
    auth: _Table, path: str, variable: str, problems: list[str]
) -> _Table | None:
    """The keys file's top-level table, its problems collected in ``problems``.

    TOML errors are reported by position only (tomli quotes no text), so a
    broken line holding a key does not print it.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
        document = tomli.loads(data.decode("utf-8"))
    except OSError as exc:
        auth.problem(
            "keys_file_env",
            f"cannot read the keys file {path} (from {variable}):"
            f" {exc.strerror or type(exc).__name__}",
        )
        return None
    except UnicodeDecodeError:
        auth.problem("keys_file_env", f"the keys file {path} (from {variable}) is not UTF-8 text")
        return None
    except tomli.TOMLDecodeError as exc:
        auth.problem(
            "keys_file_env", f"the keys file {path} (from {variable}) is not valid TOML: {exc}"
        )
        return None
    return _Table(document, "", problems)


def _read_keys(
    parent: _Table,
    *,
    in_keys_file: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> list[_KeyEntry]:
    """The ``[[keys]]`` tables under ``parent`` that read cleanly, in file order."""
    items = parent.array("keys", f"an array of tables ([[{parent.key('keys')}]])", [])
    entries: list[_KeyEntry] = []
    for index, item in enumerate(items):
        key = f"{parent.key('keys')}[{index}]"
        table = parent.nested(key, item)
        if table is None:
            parent.report(key, f"must be a table, got {_kind(item)}")
            parent.invalidate("keys")
            continue
        entry = _read_key(
            table, in_keys_file=in_keys_file, class_names=class_names, environ=environ
        )
        if entry is None:
            parent.invalidate("keys")
        else:
            entries.append(entry)
    return entries


def _read_key(
    table: _Table,
    *,
    in_keys_file: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> _KeyEntry | None:
    name = table.string("name")
    if table.ok("name") and not _NAME.fullmatch(name):
        table.problem("name", f"must match {_NAME.pattern}, got {json.dumps(name)}")
    source, digest = _read_key_digest(table, in_keys_file=in_keys_file, environ=environ)
    classes = _read_force_classes(table, class_names)
    max_concurrency = table.optional_integer("max_concurrency", minimum=1)
    if not table.finish() or digest is None:
        return None
    return table, source, ApiKeyConfig(name, digest, classes, max_concurrency)


def _read_key_digest(
    table: _Table, *, in_keys_file: bool, environ: Mapping[str, str]
) -> tuple[str, str | None]:
    """(the key that gave it, the lower-case hex digest), or a problem and None."""
    written = {name: table.secret(name) for name in ("key_sha256", "key_env", "key")}
    if written["key"] is not None and not in_keys_file:
        table.problem(
            "key",
            "a plaintext key does not belong in config.toml: write its SHA-256 as key_sha256"
            " (python -m router.auth prints it), name an environment variable with key_env,"
            " or move it to the keys file (auth.keys_file_env)",
        )
        return "key", None
    allowed = ("key_sha256", "key_env", "key") if in_keys_file else ("key_sha256", "key_env")
    given = [name for name in allowed if table.has(name)]
    if len(given) != 1:
        table.report(
            table.path,
            f"needs exactly one of {', '.join(allowed)}"
            + (f", got {' and '.join(given)}" if given else ""),
        )
        return (given or allowed)[0], None
    (source,) = given
    value = written[source]
    if value is None:  # of the wrong type, reported
        return source, None
    if source == "key_sha256":
        if not _HEX_DIGEST.fullmatch(value):
            table.problem(
                source,
                "must be the key's SHA-256 as 64 hex digits (python -m router.auth <key>"
                " prints it); the value is not shown, in case it is the key itself",
            )
            return source, None
        return source, value.lower()
    if source == "key_env":
        if not _ENV_NAME.fullmatch(value):
            table.problem(
                source,
                f"must be the name of an environment variable ({_ENV_NAME.pattern});"
                " the value is not shown, in case it is the key itself",
            )
            return source, None
        from_env = environ.get(value)
        if from_env is None:
            table.problem(source, f"environment variable {value} is not set")
            return source, None
        return source, _key_digest(table, source, from_env, f"environment variable {value}")
    return source, _key_digest(table, source, value, "the key")


def _key_digest(table: _Table, source: str, key: str, what: str) -> str | None:
    """The digest of ``key`` (surrounding whitespace dropped), if a header can carry it."""
    key = key.strip()  # a trailing newline in a secret store is a classic
    if not key:
        table.problem(source, f"{what} is empty")
        return None
    if not all("!" <= char <= "~" for char in key):
        table.problem(
            source,
            f"{what} holds characters an Authorization header cannot carry"
            " (printable ASCII without spaces only)",
        )
        return None
    return hash_key(key)


def _read_force_classes(table: _Table, class_names: Collection[str]) -> frozenset[str]:
    items = table.array("may_force_classes", "an array of class names", [])
    classes: set[str] = set()
    for index, item in enumerate(items):
        key = f"{table.key('may_force_classes')}[{index}]"
        if not isinstance(item, str):
            table.report(key, f"must be a class name, got {_describe(item)}")
        elif item not in class_names:
            defined = ", ".join(json.dumps(name) for name in class_names) or "none"
            table.report(key, f"names no defined class: {json.dumps(item)} (defined: {defined})")
        else:
            classes.add(item)
            continue
        table.invalidate("may_force_classes")
    return frozenset(classes)


def _check_unique(entries: Sequence[_KeyEntry]) -> None:
    """One name per caller and one caller per key, across config.toml and the keys file."""
    names: dict[str, str] = {}
    digests: dict[str, tuple[str, str]] = {}
    for table, source, key in entries:
        first_name = names.setdefault(key.name, table.key("name"))
        if first_name != table.key("name"):
            table.problem("name", f"{json.dumps(key.name)} is already {first_name}")
        first_path, holder = digests.setdefault(key.sha256, (table.path, key.name))
        if first_path != table.path:
            table.problem(
                source,
                f"the same key as {first_path} ({json.dumps(holder)}): a key must name one caller",
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
    if config.warnings:
        lines += [
            "warnings (tailguard runs, but fix these)",
            *(f"  {warning}" for warning in config.warnings),
            "",
        ]
    lines += _section("server", [
        ("http_listen", _host_port(server.http_host, server.http_port)),
        ("grpc_listen", _host_port(server.grpc_host, server.grpc_port)),
        ("grpc_max_calls", str(server.grpc_max_calls)),
        ("max_body_bytes", f"{server.max_body_bytes} ({server.max_body_bytes / 2**20:g} MiB)"),
        ("max_backend_body_bytes",
         f"{server.max_backend_body_bytes} ({server.max_backend_body_bytes / 2**20:g} MiB)"),
        ("reload_poll_interval",
         _seconds(server.reload_poll_interval) if server.reload_poll_interval else "off"),
        ("http_server", server.http_server),
        ("max_header_bytes", str(server.max_header_bytes)),
        ("header_timeout", _seconds(server.header_timeout)),
        ("body_timeout", _seconds(server.body_timeout)),
        ("keep_alive_timeout", _seconds(server.keep_alive_timeout)),
        ("write_timeout", _seconds(server.write_timeout)),
        ("max_connections", str(server.max_connections)),
        ("workers", str(server.workers) if server.workers > 1 else "1 (one process, no supervisor)"),
        *_render_tls(server.http_tls, server.grpc_tls),
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
        ("backend_keep_alive_timeout", _seconds(timeouts.backend_keep_alive_timeout)),
        ("end_to_end_timeout", _seconds(timeouts.end_to_end_timeout)),
        ("health_check_interval", _seconds(timeouts.health_check_interval)),
        ("health_check_timeout", _seconds(timeouts.health_check_timeout)),
        ("retry_after", _seconds(timeouts.retry_after)),
        ("front_proxy_timeout",
         "unknown" if timeouts.front_proxy_timeout is None
         else _seconds(timeouts.front_proxy_timeout)),
        ("drain_timeout", _seconds(timeouts.drain_timeout)),
    ])
    logging_config, metrics = config.logging, config.metrics
    lines += _section("logging", [
        ("level", logging_config.level),
        ("format", logging_config.format),
        ("access_log", _on_off(logging_config.access_log)),
        ("log_prompts", _on_off(logging_config.log_prompts)),
    ])
    lines += _section("metrics", [
        ("backend_scrape_interval", _seconds_or_off(metrics.backend_scrape_interval)),
        ("duplicate_request_id_window", _seconds_or_off(metrics.duplicate_request_id_window)),
    ])
    tracing = config.tracing
    if tracing.enabled:  # off (the default) is not shown, as rebalance and discovery without their pools
        lines += _section("tracing", [
            ("endpoint", tracing.endpoint),
            ("sample_ratio", f"{tracing.sample_ratio:g} (of the traces tailguard starts; a caller's traceparent decides for its own)"),
            ("service_name", tracing.service_name),
            ("headers", ", ".join(name for name, _ in tracing.headers) + " (values not shown)" if tracing.headers else "none"),
        ])
    if any(e.movable for pool in config.pools for e in pool.endpoints):
        rebalance = config.rebalance
        lines += _section("rebalance", [
            ("interval", _seconds(rebalance.interval)),
            ("hold_time", _seconds(rebalance.hold_time)),
            ("threshold", f"{rebalance.threshold:g} utilisation"),
            ("cooldown", _seconds(rebalance.cooldown)),
        ])
    if any(pool.endpoints_dns for pool in config.pools):
        discovery = config.discovery
        nameserver = discovery.nameserver
        lines += _section("discovery", [
            ("interval", _seconds(discovery.interval)),
            ("timeout", _seconds(discovery.timeout)),
            ("nameserver", "the system's (/etc/resolv.conf)" if nameserver is None else _host_port(nameserver, discovery.nameserver_port)),
        ])
    lines += _render_cluster(config.cluster)
    for pool in config.pools:
        lines += _render_pool(pool)
    lines.append("classes (the first that admits a request wins)")
    rows = [("name", "max_prompt_tokens", "max_output_tokens", "pool", "queue_timeout", "priority", "relay_interval")]
    rows += [
        (klass.name, _threshold(klass.max_prompt_tokens), _threshold(klass.max_output_tokens),
         klass.pool, _seconds(klass.queue_timeout), str(klass.priority), _seconds_or_off(klass.relay_interval))
        for klass in config.classes
    ]
    lines += _aligned(rows, indent="  ")
    lines += ["", *_render_auth(config.auth)]
    return "\n".join(lines) + "\n"


def _render_cluster(cluster: ClusterConfig | None) -> list[str]:
    """``[cluster]``, or that there is none: whether caps are this process's alone is the first
    thing an operator running replicas needs to know. A password in the URL is not shown."""
    if cluster is None:
        return _section("cluster", [("redis_url", "none (this process holds every cap alone; replicas would each hold them too)")])
    return _section("cluster", [
        ("redis_url", _without_password(cluster.redis_url)),
        ("namespace", cluster.namespace),
        ("replica_id", cluster.replica_id or "(the host name and the serving process's id)"),
        ("lease_ttl", _seconds(cluster.lease_ttl)),
        ("sync_interval", _seconds(cluster.sync_interval)),
        ("static_share", f"{cluster.static_share:g} of each cap while Redis is away"),
        ("block", f"{cluster.block} spare seats"),
    ])


def _without_password(url: str) -> str:
    """``url`` with the password of its user part (``redis://:secret@host``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _render_tls(http_tls: TlsConfig | None, grpc_tls: TlsConfig | None) -> list[tuple[str, str]]:
    """The listeners' TLS by their files' paths (never their contents); one row when both are off."""
    if http_tls is None and grpc_tls is None:
        return [("http_tls, grpc_tls", "off (plain TCP)")]

    def shown(tls: TlsConfig | None) -> str:
        if tls is None:
            return "off (plain TCP)"
        clients = "any client" if tls.client_ca_file is None else f"client certificates required, signed by {tls.client_ca_file}"
        return f"cert {tls.cert_file}, key {tls.key_file}; {clients}"

    return [("http_tls", shown(http_tls)), ("grpc_tls", shown(grpc_tls))]


def _render_auth(auth: AuthConfig) -> list[str]:
    """Who may call: names, rights and a digest prefix to tell keys apart; no secret."""
    if not auth.enabled:
        return ["auth", "  off (no keys: every caller is anonymous and may force no class)"]
    lines = ["auth (API keys; sha256 is the start of each key's digest)"]
    if auth.keys_file is not None:
        lines.append(f"  keys_file  {auth.keys_file}")
    rows = [("name", "sha256", "may_force_classes", "max_concurrency")]
    rows += [
        (key.name, key.sha256[:8], ", ".join(sorted(key.may_force_classes)) or "none",
         "no cap" if key.max_concurrency is None else str(key.max_concurrency))
        for key in auth.keys
    ]
    return lines + _aligned(rows, indent="  ")


def _render_pool(pool: PoolConfig) -> list[str]:
    total = sum(endpoint.max_concurrency for endpoint in pool.endpoints)
    endpoints = _aligned(
        [
            (point.url, f"max_concurrency {point.max_concurrency}" + (", movable" if point.movable else "") + _own_key(point.access, pool))
            for point in pool.endpoints
        ],
        indent="",
    ) or ["(none: only those DNS names)" if pool.endpoints_dns else "(none: the pool has no GPUs now)"]
    dns = [
        f"{source.scheme}://{source.name}:{source.port} (each A/AAAA address), max_concurrency {source.max_concurrency} each"
        + _own_key(source.access, pool)
        for source in pool.endpoints_dns
    ]
    notes = [f"endpoints' sum {total}"] if pool.endpoints or not dns else []
    notes += ["stays whatever the number of DNS addresses"] if dns else []
    sum_note = "; ".join(notes)
    pairs = [
        ("max_concurrency", f"{pool.max_concurrency} ({sum_note})"),
        ("max_queue", str(pool.max_queue)),
        ("max_model_len", _max_model_len(pool)),
        ("models", ", ".join(pool.models)),
        ("simulate_profile", pool.simulate_profile),
        ("fail_fast_fraction", _fail_fast(pool.fail_fast_fraction)),
        ("first_byte_timeout", _seconds(pool.first_byte_timeout)),
        (
            "health_check",
            f"{pool.health_check}; down after unhealthy_threshold {pool.unhealthy_threshold} failed in a row,"
            f" up after healthy_threshold {pool.healthy_threshold} passed",
        ),
        ("api_key_env", _api_key(pool.access)),
        *((("tls_ca_file", pool.access.tls_ca_file),) if pool.access.tls_ca_file else ()),
        ("outlier_detection", _outlier(pool.outlier_detection)),
        *((("lend", _lend(pool.lend)),) if pool.lend.to else ()),
        *((("class_max_concurrency", ", ".join(f"{n} {seats}" for n, seats in pool.class_max_concurrency)),) if pool.class_max_concurrency else ()),
        *((("vllm_priority", "on (class priority sent as vLLM's priority)"),) if pool.vllm_priority else ()),
        *((("stream_upstream", "on (whole answers asked of vLLM as streams, put together here)"),) if pool.stream_upstream else ()),
        *((("rebalance", "off (no endpoint moves in or out)"),) if pool.rebalance == "off" else ()),
        ("endpoints", endpoints[0]),
        *(("", line) for line in endpoints[1:]),
        *((("endpoints_dns", dns[0]),) if dns else ()),
        *(("", line) for line in dns[1:]),
    ]
    return _section(f"pool {pool.name}", pairs)


def _api_key(access: BackendAccess) -> str:
    if access.api_key_env is None:
        return "none (no Authorization sent to the engines: they run without --api-key)"
    return f"{access.api_key_env} (set; sent as Authorization: Bearer to /v1/*, value not shown)"


def _own_key(access: BackendAccess, pool: PoolConfig) -> str:
    """An entry's own api_key_env, when it overrides the pool's."""
    return "" if access.api_key_env == pool.access.api_key_env else f", api_key_env {access.api_key_env}"


def _max_model_len(pool: PoolConfig) -> str:
    if pool.max_model_len_configured:
        return str(pool.max_model_len)
    found = f"{pool.max_model_len} now; " if pool.max_model_len else ""
    return f"{found}asked of the endpoints at start and on every reload (GET /v1/models: the smallest they report)"


def _lend(lend: LendConfig) -> str:
    bounds = [f"at most {lend.max_seats} seats" if lend.max_seats is not None else "any idle seat", f"keeps {lend.reserve} free"]
    if lend.max_prompt_tokens is not None:
        bounds.append(f"prompts up to {lend.max_prompt_tokens} tokens")
    if lend.max_output_tokens is not None:
        bounds.append(f"max_tokens up to {lend.max_output_tokens}")
    return f"to {', '.join(lend.to)}: " + ", ".join(bounds)


def _outlier(outlier: OutlierDetectionConfig) -> str:
    return (
        f"eject after {outlier.consecutive_failures} failures in a row for"
        f" {_seconds(outlier.base_ejection_time)} x ejections (at most"
        f" {_seconds(outlier.max_ejection_time)}), at most {outlier.max_ejection_percent:g}%"
        " of endpoints"
        + (
            f"; or when {outlier.failure_ratio:g} of its last {outlier.failure_window} requests"
            f" (at least {outlier.failure_min_requests}) failed and the others' did not"
            if outlier.failure_ratio
            else ""
        )
    )


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


def _seconds_or_off(value: float) -> str:
    return _seconds(value) if value else "off"


def _fail_fast(fraction: float) -> str:
    if not fraction:
        return "off (requests wait out their queue_timeout)"
    return f"{fraction:g} (refuse at arrival when the expected wait is over {fraction:g} x queue_timeout)"


def _on_off(value: bool) -> str:
    return "on" if value else "off"


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
        "max_body_bytes": config.server.max_body_bytes,
        "retry_after": config.timeouts.retry_after,
        "auth_required": config.auth.enabled,
    }
