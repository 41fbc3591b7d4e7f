"""Read the process-wide sections: server, estimate, limits, timeouts, logging, metrics, cluster, rebalance, discovery, tracing."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import get_args
from urllib.parse import urlsplit

from .keys import env_digest
from .table import ENV_NAME, Table, join_key, kind
from .tls import TlsFileError, checked as checked_tls
from .types import (
    ClusterConfig,
    DiscoveryConfig,
    EstimateConfig,
    LimitsConfig,
    LogFormat,
    LoggingConfig,
    LogLevel,
    MetricsConfig,
    OverCapMode,
    RebalanceConfig,
    RetryAfterHint,
    ServerConfig,
    TimeoutsConfig,
    TlsConfig,
    TracingConfig,
)

_OVER_CAP_MODES: tuple[OverCapMode, ...] = get_args(OverCapMode)
_RETRY_AFTER_HINTS: tuple[RetryAfterHint, ...] = get_args(RetryAfterHint)
_LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
_LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")
# Ratios kept per model and kind of text (router/admission/prompt_ratios.py): 64 models x 6 kinds x this, at most.
_MAX_LEARN_WINDOW = 4096


def read_server(table: Table) -> ServerConfig:
    default = ServerConfig()
    http_host, http_port = _listen(table, "http_listen", default.http_host, default.http_port)
    grpc_host, grpc_port = _listen(table, "grpc_listen", default.grpc_host, default.grpc_port)
    metrics_listen = _read_metrics_listen(table, ((http_host, http_port), (grpc_host, grpc_port)))
    max_body_bytes = table.integer("max_body_bytes", default.max_body_bytes, minimum=1)
    grpc_max_calls = table.integer("grpc_max_calls", default.grpc_max_calls, minimum=1)
    max_backend_body_bytes = table.integer(
        "max_backend_body_bytes", default.max_backend_body_bytes, minimum=1024
    )
    reload_poll_interval = table.number(
        "reload_poll_interval", default.reload_poll_interval, minimum=0.0, inclusive=True
    )
    _read_http_server(table)
    max_header_bytes = table.integer("max_header_bytes", default.max_header_bytes, minimum=1024)
    header_timeout = table.number("header_timeout", default.header_timeout, minimum=0.0)
    body_timeout = table.number("body_timeout", default.body_timeout, minimum=0.0)
    keep_alive_timeout = table.number("keep_alive_timeout", default.keep_alive_timeout, minimum=0.0)
    write_timeout = table.number("write_timeout", default.write_timeout, minimum=0.0)
    max_connections = table.integer("max_connections", default.max_connections, minimum=1)
    workers = table.integer("workers", default.workers, minimum=1)
    http_tls = _read_tls(table, "http_tls")
    grpc_tls = _read_tls(table, "grpc_tls")
    session_header = _read_session_header(table, default.session_header)
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
        max_header_bytes=max_header_bytes,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        keep_alive_timeout=keep_alive_timeout,
        write_timeout=write_timeout,
        max_connections=max_connections,
        workers=workers,
        http_tls=http_tls,
        grpc_tls=grpc_tls,
        session_header=session_header,
        metrics_listen=metrics_listen,
    )


def _read_metrics_listen(table: Table, taken: tuple[tuple[str, int], ...]) -> tuple[str, int] | None:
    """``metrics_listen``: absent, /metrics is served on the HTTP API's listener; a port of its own may not be another listener's."""
    if not table.has("metrics_listen"):
        table.optional_string("metrics_listen")  # known, absent
        return None
    host, port = _listen(table, "metrics_listen", "127.0.0.1", 0)
    if table.ok("metrics_listen") and port != 0 and any(port == other_port for _, other_port in taken):
        table.problem("metrics_listen", f"must not be the port of http_listen or grpc_listen, got {host_port(host, port)}")
    return host, port


def _read_session_header(table: Table, default: str) -> str:
    """``session_header``: a header name (any case; kept lower case, as both front ends see names), or "" for none."""
    name = table.string("session_header", default)
    if table.ok("session_header") and name and not _HEADER_NAME.fullmatch(name):
        table.problem("session_header", f'must be an HTTP header name (letters, digits, "-"; "" for none), got {json.dumps(name)}')
        return default
    return name.lower()


def _read_http_server(table: Table) -> None:
    """``http_server``, a key of files from before tailguard served HTTP only itself.

    ``"lean"`` (tailguard's own server) is what runs anyway: accepted, no
    effect. Any other server is gone, and a file asking for one is refused
    rather than served by something it did not ask for.
    """
    written = table.string("http_server", "lean")
    if not table.ok("http_server") or written == "lean":
        return
    table.problem("http_server", f'must be "lean" or left out (tailguard serves HTTP itself, no other server), got {json.dumps(written)}')


def _read_tls(server: Table, name: str) -> TlsConfig | None:
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


def _listen(table: Table, name: str, host: str, port: int) -> tuple[str, int]:
    text = table.string(name, host_port(host, port))
    if not table.ok(name):
        return host, port
    try:
        return parse_listen(text)
    except ValueError as exc:
        table.problem(name, f"{exc}, got {json.dumps(text)}")
        return host, port


def parse_listen(text: str) -> tuple[str, int]:
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


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_estimate(table: Table) -> EstimateConfig:
    default = EstimateConfig()
    chars = table.number("chars_per_token", default.chars_per_token, minimum=0.0)
    cjk = table.number("cjk_chars_per_token", default.cjk_chars_per_token, minimum=0.0)
    per_message = table.integer("per_message_tokens", default.per_message_tokens, minimum=0)
    learn = table.boolean("learn", default.learn)
    window = table.integer("learn_window", default.learn_window, minimum=1)
    quantile = table.number("learn_quantile", default.learn_quantile, minimum=0.0)
    after = table.integer("learn_after", default.learn_after, minimum=1)
    most = table.number("max_ratio", default.max_ratio, minimum=1.0, inclusive=True)
    if table.ok("learn_quantile") and quantile > 1.0:
        table.problem("learn_quantile", f"must be a number > 0 and <= 1 (0.95: all but 1 in 20 recent prompts), got {quantile:g}")
    if table.ok("learn_window", "learn_after") and after > window:
        table.problem("learn_after", f"must be at most learn_window ({window}), got {after}: a kind would never apply")
    if table.ok("learn_window") and window > _MAX_LEARN_WINDOW:
        table.problem("learn_window", f"must be at most {_MAX_LEARN_WINDOW} (ratios kept per model and kind), got {window}")
    table.finish()
    return EstimateConfig(
        chars_per_token=chars,
        cjk_chars_per_token=cjk,
        per_message_tokens=per_message,
        learn=learn,
        learn_window=window,
        learn_quantile=quantile,
        learn_after=after,
        max_ratio=most,
    )


def read_limits(table: Table) -> LimitsConfig:
    default = LimitsConfig()
    input_cap = table.integer("input_cap_tokens", default.input_cap_tokens, minimum=1)
    default_max = table.integer("default_max_tokens", default.default_max_tokens, minimum=1)
    output_cap = table.integer("output_cap_tokens", default.output_cap_tokens, minimum=1)
    over_cap = table.choice("over_cap", _OVER_CAP_MODES, default.over_cap)
    max_n = table.integer("max_n", default.max_n, minimum=1)
    anonymous_tokens = table.optional_integer("anonymous_tokens_per_minute", minimum=1)
    anonymous_requests = table.optional_integer("anonymous_requests_per_minute", minimum=1)
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
        max_n=max_n,
        anonymous_tokens_per_minute=anonymous_tokens,
        anonymous_requests_per_minute=anonymous_requests,
    )


def read_timeouts(table: Table) -> TimeoutsConfig:
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
    hint = table.choice("retry_after_hint", _RETRY_AFTER_HINTS, default.retry_after_hint)
    table.finish()
    return TimeoutsConfig(**values, front_proxy_timeout=front_proxy, drain_timeout=drain, retry_after_hint=hint)


def read_logging(table: Table) -> LoggingConfig:
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


def read_metrics(table: Table, environ: Mapping[str, str]) -> MetricsConfig:
    """``[metrics]``; ``token_env`` is resolved from ``environ`` now (a variable not set refuses the file)."""
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
    caller_series = table.integer("caller_series", default.caller_series, minimum=0)
    token_env = table.optional_string("token_env")
    token_sha256 = None
    if token_env is not None and table.ok("token_env"):
        if ENV_NAME.fullmatch(token_env):
            token_sha256 = env_digest(table, "token_env", token_env, environ)
        else:
            table.problem("token_env", f"must be the name of an environment variable ({ENV_NAME.pattern}), got {json.dumps(token_env)}")
    table.finish()
    return MetricsConfig(
        backend_scrape_interval=scrape,
        duplicate_request_id_window=window,
        caller_series=caller_series,
        token_env=token_env,
        token_sha256=token_sha256,
    )


def read_cluster(table: Table, present: bool) -> ClusterConfig | None:
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


def read_rebalance(table: Table) -> RebalanceConfig:
    default = RebalanceConfig()
    interval = table.number("interval", default.interval, minimum=0.0)
    hold = table.number("hold_time", default.hold_time, minimum=0.0, inclusive=True)
    threshold = table.number("threshold", default.threshold, minimum=0.0)
    cooldown = table.number("cooldown", default.cooldown, minimum=0.0, inclusive=True)
    if table.ok("interval", "hold_time") and hold < interval:
        table.problem("hold_time", f"{hold:g} s must be at least {table.key('interval')} {interval:g} s")
    step = table.number("seat_step", default.seat_step, minimum=0.0)
    if table.ok("seat_step") and step > 1:
        table.problem("seat_step", f"must be at most 1 (a share of one engine's seats; 1 moves whole engines), got {step:g}")
    table.finish()
    return RebalanceConfig(interval=interval, hold_time=hold, threshold=threshold, cooldown=cooldown, seat_step=step)




def read_discovery(table: Table) -> DiscoveryConfig:
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


def read_tracing(table: Table) -> TracingConfig:
    """``[tracing]``: where spans go and how many traces are kept (router/observe/tracing.py makes them)."""
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
    written: Mapping[str, object] = table.mapping("headers", "a table of header names to strings")
    for name, value in written.items():
        key = join_key(table.key("headers"), name)
        if not _HEADER_NAME.fullmatch(name):
            table.report(key, "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
            table.invalidate("headers")
        elif not isinstance(value, str):  # the value may be a credential: never quoted
            table.report(key, f"must be a string, got {kind(value)} (its value is not shown)")
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

