"""Show the effective configuration, defaults filled in, for ``tailguard check-config``."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from .sections import host_port
from .types import (
    GENERATION_KINDS,
    REQUEST_KINDS,
    AuthConfig,
    BackendAccess,
    ClusterConfig,
    Config,
    LendConfig,
    OutlierDetectionConfig,
    PlacementConfig,
    PoolConfig,
    ServerConfig,
    TlsConfig,
)

__all__ = ["render_config"]


def render_config(config: Config) -> str:
    """The effective settings, defaults filled in, for ``tailguard check-config``.

    Every value is shown, including those the file left out, under the same
    key names as ``config.toml``, so an operator sees what the process will do.
    """
    lines = [f"tailguard configuration, digest {config.digest or '(none)'}", ""]
    if config.warnings:
        lines += [
            "warnings (tailguard runs, but fix these)",
            *(f"  {warning}" for warning in config.warnings),
            "",
        ]
    lines += _render_server(config.server)
    lines += _render_request_rules(config)
    lines += _render_observability(config)
    lines += _render_moves(config)
    lines += _render_cluster(config.cluster)
    for pool in config.pools:
        lines += _render_pool(pool)
    lines += _render_classes(config)
    lines += ["", *_render_auth(config.auth)]
    return "\n".join(lines) + "\n"


def _render_server(server: ServerConfig) -> list[str]:
    """``[server]``: the listeners and the HTTP server's bounds."""
    return _section("server", [
        ("http_listen", host_port(server.http_host, server.http_port)),
        ("grpc_listen", host_port(server.grpc_host, server.grpc_port)),
        ("metrics_listen", "none (GET /metrics on http_listen)" if server.metrics_listen is None else host_port(*server.metrics_listen)),
        ("grpc_max_calls", str(server.grpc_max_calls)),
        ("max_body_bytes", f"{server.max_body_bytes} ({server.max_body_bytes / 2**20:g} MiB)"),
        ("max_backend_body_bytes",
         f"{server.max_backend_body_bytes} ({server.max_backend_body_bytes / 2**20:g} MiB)"),
        ("reload_poll_interval",
         _seconds(server.reload_poll_interval) if server.reload_poll_interval else "off"),
        ("max_header_bytes", str(server.max_header_bytes)),
        ("header_timeout", _seconds(server.header_timeout)),
        ("body_timeout", _seconds(server.body_timeout)),
        ("keep_alive_timeout", _seconds(server.keep_alive_timeout)),
        ("write_timeout", _seconds(server.write_timeout)),
        ("max_connections", str(server.max_connections)),
        ("workers", str(server.workers) if server.workers > 1 else "1 (one process, no supervisor)"),
        ("session_header", server.session_header or '"" (none)'),
        *_render_tls(server.http_tls, server.grpc_tls),
    ])


def _render_request_rules(config: Config) -> list[str]:
    """``[estimate]``, ``[limits]`` and ``[timeouts]``: what a request may be and how long it may take."""
    estimate, limits, timeouts = config.estimate, config.limits, config.timeouts
    lines = _section("estimate", [
        ("chars_per_token", f"{estimate.chars_per_token:g}"),
        ("cjk_chars_per_token", f"{estimate.cjk_chars_per_token:g}"),
        ("per_message_tokens", str(estimate.per_message_tokens)),
        ("learn", (
            f"on: each model's real/estimated ratio per kind of text, learn_quantile {estimate.learn_quantile:g} of the last "
            f"learn_window {estimate.learn_window}, from learn_after {estimate.learn_after}, in [1, max_ratio {estimate.max_ratio:g}]"
        ) if estimate.learn else "off: the rule alone"),
    ])
    lines += _section("limits", [
        ("input_cap_tokens", str(limits.input_cap_tokens)),
        ("default_max_tokens", str(limits.default_max_tokens)),
        ("output_cap_tokens", f"{limits.output_cap_tokens} (over the cap: {limits.over_cap})"),
        ("max_n", f"{limits.max_n} sequences a request (n), each a seat"),
    ])
    lines += _section("timeouts", [
        ("connect_timeout", _seconds(timeouts.connect_timeout)),
        ("backend_keep_alive_timeout", _seconds(timeouts.backend_keep_alive_timeout)),
        ("end_to_end_timeout", _seconds(timeouts.end_to_end_timeout)),
        ("health_check_interval", _seconds(timeouts.health_check_interval)),
        ("health_check_timeout", _seconds(timeouts.health_check_timeout)),
        ("retry_after", _seconds(timeouts.retry_after)),
        ("retry_after_hint", "computed: when a seat or an endpoint is expected, retry_after the floor" if timeouts.retry_after_hint == "computed" else "fixed: retry_after"),
        ("front_proxy_timeout",
         "unknown" if timeouts.front_proxy_timeout is None
         else _seconds(timeouts.front_proxy_timeout)),
        ("drain_timeout", _seconds(timeouts.drain_timeout)),
    ])
    return lines


def _render_observability(config: Config) -> list[str]:
    """``[logging]``, ``[metrics]`` and, when on, ``[tracing]``."""
    logging_config, metrics = config.logging, config.metrics
    lines = _section("logging", [
        ("level", logging_config.level),
        ("format", logging_config.format),
        ("access_log", _on_off(logging_config.access_log)),
        ("log_prompts", _on_off(logging_config.log_prompts)),
    ])
    lines += _section("metrics", [
        ("backend_scrape_interval", _seconds_or_off(metrics.backend_scrape_interval)),
        ("duplicate_request_id_window", _seconds_or_off(metrics.duplicate_request_id_window)),
        ("caller_series", f"{metrics.caller_series} callers by name, the rest as caller=\"(other)\""),
        ("token_env", "none (GET /metrics is open)" if metrics.token_env is None else f"{metrics.token_env} (value not shown)"),
    ])
    tracing = config.tracing
    if tracing.enabled:  # off (the default) is not shown, as rebalance and discovery without their pools
        lines += _section("tracing", [
            ("endpoint", tracing.endpoint),
            ("sample_ratio", f"{tracing.sample_ratio:g} (of the traces tailguard starts; a caller's traceparent decides for its own)"),
            ("service_name", tracing.service_name),
            ("headers", ", ".join(name for name, _ in tracing.headers) + " (values not shown)" if tracing.headers else "none"),
        ])
    return lines


def _render_moves(config: Config) -> list[str]:
    """``[rebalance]`` and ``[discovery]``, shown only when a pool has what they move."""
    lines: list[str] = []
    if any(e.movable for pool in config.pools for e in pool.endpoints):
        rebalance = config.rebalance
        lines += _section("rebalance", [
            ("interval", _seconds(rebalance.interval)),
            ("hold_time", _seconds(rebalance.hold_time)),
            ("threshold", f"{rebalance.threshold:g} utilisation"),
            ("cooldown", _seconds(rebalance.cooldown)),
            ("seat_step", "whole engines" if rebalance.seat_step >= 1 else f"{rebalance.seat_step:g} of an engine's seats a move"),
        ])
    if any(pool.endpoints_dns for pool in config.pools):
        discovery = config.discovery
        nameserver = discovery.nameserver
        lines += _section("discovery", [
            ("interval", _seconds(discovery.interval)),
            ("timeout", _seconds(discovery.timeout)),
            ("nameserver", "the system's (/etc/resolv.conf)" if nameserver is None else host_port(nameserver, discovery.nameserver_port)),
        ])
    return lines


def _kinds(kinds: frozenset[str]) -> str:
    """A class's request kinds, "generation" for the default four."""
    if kinds == GENERATION_KINDS:
        return "generation"
    return ",".join(kind for kind in REQUEST_KINDS if kind in kinds)


def _render_classes(config: Config) -> list[str]:
    """The classes as one table, in match order."""
    lines = ["classes (the first that admits a request wins)"]
    rows = [("name", "kinds", "max_prompt_tokens", "max_output_tokens", "pool", "queue_timeout", "priority", "relay_interval", "prompt_bound")]
    rows += [
        (klass.name, _kinds(klass.kinds), _threshold(klass.max_prompt_tokens), _threshold(klass.max_output_tokens),
         klass.pool, _seconds(klass.queue_timeout), str(klass.priority), _seconds_or_off(klass.relay_interval),
         klass.prompt_bound)
        for klass in config.classes
    ]
    lines += _aligned(rows, indent="  ")
    lines.append("objectives (what each class is promised; docs/objectives.md)")
    targets = [("class", "ttft", "itl", "e2e", "percentile", "throughput_share")]
    targets += [
        (klass.name, _seconds_or_off(klass.objective.ttft or 0.0), _seconds_or_off(klass.objective.itl or 0.0),
         _seconds(klass.objective.e2e), f"{klass.objective.percentile:g}", f"{klass.objective.throughput_share:g}")
        for klass in config.classes
    ]
    lines += _aligned(targets, indent="  ")
    return lines


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
    rows = [("name", "sha256", "may_force_classes", "max_concurrency", "weight", "tokens/min", "requests/min")]
    rows += [
        (key.name, key.sha256[:8], ", ".join(sorted(key.may_force_classes)) or "none",
         "no cap" if key.max_concurrency is None else str(key.max_concurrency), f"{key.weight:g}",
         _budget(key.tokens_per_minute), _budget(key.requests_per_minute))
        for key in auth.keys
    ]
    return lines + _aligned(rows, indent="  ")


def _placement(placement: PlacementConfig) -> str:
    """A pool's placement on one line: affinity's bound and key, or load alone; the cache salt if any."""
    if placement.mode == "least_loaded":
        text = "least_loaded (load alone)"
    else:
        text = (
            f"prefix_affinity (affinity_load_factor {placement.load_factor:g}, "
            f"affinity_blocks {placement.blocks}: the key covers {placement.blocks * 16} leading tokens)"
        )
    return text + ("; cache_salt caller (callers share no cached prefix)" if placement.cache_salt == "caller" else "")


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
        ("queue_order", "callers in fair shares of the tokens served" if pool.queue_order == "fair" else "arrival, across callers"),
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
        ("placement", _placement(pool.placement)),
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


def _budget(per_minute: int | None) -> str:
    return "none" if per_minute is None else f"{per_minute:,}"


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
        yields = "" if lend.max_imbalance is None else f" (any, while the borrower is fuller by over {lend.max_imbalance:g} of the seats)"
        bounds.append(f"prompts up to {lend.max_prompt_tokens} tokens{yields}")
    if lend.max_output_tokens is not None:
        bounds.append(f"max_tokens up to {lend.max_output_tokens}")
    if lend.ttft_budget is not None:
        bounds.append(f"while its own streams' first byte comes within {_seconds(lend.ttft_budget)}")
    if lend.prefills is not None:
        bounds.append(f"{lend.prefills} borrowed prefill{'s' if lend.prefills != 1 else ''} at once an endpoint")
    when = "whenever the borrower is busier" if lend.when == "busier" else "once the borrower is full"
    return f"to {', '.join(lend.to)}, {when}: " + ", ".join(bounds)


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

