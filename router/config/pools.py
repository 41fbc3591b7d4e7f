"""Read the pools (their endpoints, DNS names, lending, outlier detection) and the classes routed to them."""

from __future__ import annotations

import ipaddress
import json
import re
import ssl
from collections.abc import Collection, Mapping, Sequence
from typing import get_args
from urllib.parse import urlsplit

from .objectives import check_throughput_shares, read_objective
from .sections import host_port
from .table import ENV_NAME, Table, describe
from .types import (
    GENERATION_KINDS,
    REQUEST_KINDS,
    BackendAccess,
    CacheSaltMode,
    ClassConfig,
    DnsEndpointsConfig,
    DnsScheme,
    EndpointConfig,
    HealthCheckKind,
    LendConfig,
    LendWhen,
    OutlierDetectionConfig,
    PlacementConfig,
    PlacementMode,
    PoolConfig,
    PromptBound,
    QueueOrder,
    RebalanceMode,
    SimulateProfile,
)

# A class's objective e2e left out is timeouts.end_to_end_timeout; this when that key itself was refused.
_DEFAULT_END_TO_END = 120.0
# A class's relay_interval above this would show as a stalled stream, not as tokens in bursts.
_MAX_RELAY_INTERVAL = 1.0
# A pool's max_queue left out: this many waiting requests per seat. Deeper, and
# a request near the back would mostly wait out its class's queue_timeout
# (fail_fast_fraction refuses those sooner anyway); the shipped interactive
# pool's 256 for 64 seats.
_QUEUE_PER_SEAT = 4
_SIMULATE_PROFILES: tuple[SimulateProfile, ...] = get_args(SimulateProfile)
_HEALTH_CHECKS: tuple[HealthCheckKind, ...] = get_args(HealthCheckKind)
_REBALANCE_MODES: tuple[RebalanceMode, ...] = get_args(RebalanceMode)
_PLACEMENT_MODES: tuple[PlacementMode, ...] = get_args(PlacementMode)
_PROMPT_BOUNDS: tuple[PromptBound, ...] = get_args(PromptBound)
_CACHE_SALT_MODES: tuple[CacheSaltMode, ...] = get_args(CacheSaltMode)
_LEND_WHEN: tuple[LendWhen, ...] = get_args(LendWhen)
_QUEUE_ORDERS: tuple[QueueOrder, ...] = get_args(QueueOrder)
# The key covers at most this many leading blocks (4,096 tokens, ~16 KiB of text): its cost grows with them.
MAX_AFFINITY_BLOCKS = 256
_DNS_SCHEMES: tuple[DnsScheme, ...] = get_args(DnsScheme)
_DNS_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def read_pools(
    tables: Sequence[tuple[str, Table]], input_cap: int | None, environ: Mapping[str, str]
) -> tuple[PoolConfig, ...]:
    """The pools that read cleanly; an endpoint URL may appear only once overall."""
    used_urls: dict[str, str] = {}
    used_names: dict[tuple[str, int, str], str] = {}
    pools = (_read_pool(name, table, input_cap, used_urls, used_names, environ) for name, table in tables)
    return tuple(pool for pool in pools if pool is not None)


def _read_pool(
    name: str,
    table: Table,
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
    queue_order = table.choice("queue_order", _QUEUE_ORDERS, PoolConfig.queue_order)
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
    placement = _read_placement(table)
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
        queue_order=queue_order,
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
        placement=placement,
        endpoints_dns=endpoints_dns,
        max_model_len_configured=max_model_len is not None,
        access=access,
    )


def _read_placement(table: Table) -> PlacementConfig:
    """``placement``, ``affinity_load_factor``, ``affinity_blocks`` and ``cache_salt``: how the pool places its seats."""
    default = PlacementConfig()
    mode = table.choice("placement", _PLACEMENT_MODES, default.mode)
    factor = table.number("affinity_load_factor", default.load_factor, minimum=1.0, inclusive=True)
    blocks = table.integer("affinity_blocks", default.blocks, minimum=1)
    if table.ok("affinity_blocks") and blocks > MAX_AFFINITY_BLOCKS:
        table.problem(
            "affinity_blocks",
            f"must be at most {MAX_AFFINITY_BLOCKS} (the key reads that many 16-token blocks of every prompt), got {blocks}",
        )
    salt = table.choice("cache_salt", _CACHE_SALT_MODES, default.cache_salt)
    return PlacementConfig(mode=mode, load_factor=factor, blocks=blocks, cache_salt=salt)


def _read_pool_cap(table: Table, endpoints: Sequence[EndpointConfig]) -> int:
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
    pool: Table, used_names: dict[tuple[str, int, str], str], access: BackendAccess, environ: Mapping[str, str]
) -> tuple[DnsEndpointsConfig, ...]:
    """``endpoints_dns``: names whose addresses are endpoints (router/fleet/discovery.py); one pool per name and port."""
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




def _read_lend(table: Table, pool: str, max_concurrency: int | None) -> LendConfig:
    """``[pools.NAME.lend]``; which pools it names is checked once all are read."""
    names = table.array("to", "an array of pool names", [])
    to: list[str] = []
    for name in names:
        if not isinstance(name, str):
            table.problem("to", f"must hold pool names (strings), got {describe(name)}")
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
    prefills = table.optional_integer("prefills", minimum=1)
    when = table.choice("when", _LEND_WHEN, LendConfig.when)
    ttft_budget = table.optional_number("ttft_budget", minimum=0.0)
    max_imbalance = table.optional_number("max_imbalance", minimum=0.0)
    if table.ok("max_imbalance") and max_imbalance is not None and max_imbalance > 1:
        table.problem("max_imbalance", f"must be at most 1 (a share of the seats), got {max_imbalance:g}")
    table.finish()
    return LendConfig(
        to=tuple(to),
        max_seats=max_seats,
        reserve=reserve,
        max_prompt_tokens=max_prompt,
        max_output_tokens=max_output,
        prefills=prefills,
        when=when,
        ttft_budget=ttft_budget,
        max_imbalance=max_imbalance,
    )


def _read_class_limits(pool: Table) -> tuple[tuple[str, int], ...]:
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


def check_pool_references(
    pools: Sequence[PoolConfig], classes: Sequence[ClassConfig], pool_tables: Mapping[str, Table]
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


def _read_outlier_detection(table: Table) -> OutlierDetectionConfig:
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


def _read_access(table: Table, inherited: BackendAccess, environ: Mapping[str, str], *, pool: bool = False) -> BackendAccess:
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
            if not ENV_NAME.fullmatch(name):
                table.problem("api_key_env", f"must be the name of an environment variable ({ENV_NAME.pattern}), got {json.dumps(name)}")
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
    pool: Table, used_urls: dict[str, str], access: BackendAccess, environ: Mapping[str, str]
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


def _read_url(table: Table, used_urls: dict[str, str]) -> str:
    text = table.string("url")
    if not table.ok("url"):
        return text
    try:
        url = normalise_url(text)
    except ValueError as exc:
        table.problem("url", f"{exc}, got {json.dumps(text)}")
        return text
    first = used_urls.setdefault(url, table.key("url"))
    if first != table.key("url"):
        table.problem("url", f"{url} is already {first}; an endpoint belongs to one pool, once")
    return url


def normalise_url(text: str) -> str:
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
    return f"{scheme}://{host_port(host, port or _DEFAULT_PORTS[scheme])}"


def _read_models(pool: Table) -> tuple[str, ...]:
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
            pool.report(key, f"must be a non-empty string, got {describe(item)}")
    return tuple(models)


def read_classes(
    tables: Sequence[tuple[str, Table]],
    pool_names: Collection[str],
    end_to_end: float | None,
) -> tuple[ClassConfig, ...]:
    """The classes in file order (the match order), checked to cover every request of every kind they take.

    Per request kind, the classes that take it match in file order, and the
    last of them must be a catch-all: the generating kinds always need one;
    a pooling kind (embeddings, rerank) needs one once any class takes it
    (else its requests are answered 404: no class serves them). A class
    every kind of which a catch-all before it takes is unreachable.
    """
    catch_all: dict[str, str] = {}  # kind -> the catch-all class that takes it
    last: dict[str, Table] = {}  # kind -> the last class that takes it
    for _name, table in tables:
        key = table.path
        kinds = _kinds(table)
        is_catch_all = not table.has("max_prompt_tokens") and not table.has("max_output_tokens")
        if kinds and all(kind in catch_all for kind in kinds):
            before = catch_all[sorted(kinds)[0]]
            table.report(key, f"unreachable: {before} before it has no thresholds and takes every request")
            continue
        for kind in kinds:
            last[kind] = table
            if is_catch_all:
                catch_all.setdefault(kind, key)
    uncovered: dict[str, list[str]] = {}  # the last class of each kind with no catch-all -> those kinds
    for kind in sorted(last.keys() | GENERATION_KINDS):
        if kind not in catch_all and kind in last:
            uncovered.setdefault(last[kind].path, []).append(kind)
    for table in {id(t): t for t in last.values()}.values():
        kinds_left = uncovered.get(table.path)
        if kinds_left:
            which = "a request" if set(kinds_left) >= GENERATION_KINDS else f"a {' or '.join(kinds_left)} request"
            table.report(
                table.path,
                f"the last class must be a catch-all (no max_prompt_tokens, no max_output_tokens), or {which} over its thresholds would fit no class",
            )
    if tables and not GENERATION_KINDS <= last.keys():
        tables[-1][1].report(tables[-1][1].path, "no class takes chat, completion, responses and messages requests: one must be a catch-all for them")
    read = (_read_class(name, table, pool_names, end_to_end, index) for index, (name, table) in enumerate(tables))
    classes = tuple(klass for klass in read if klass is not None)
    if tables:
        check_throughput_shares(classes, tables[0][1])
    return classes


def _read_class(
    name: str, table: Table, pool_names: Collection[str], end_to_end: float | None, index: int
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
    prompt_bound = table.choice("prompt_bound", _PROMPT_BOUNDS, "all")
    kinds = _kinds(table, report=True)
    objective = read_objective(
        table.table("objective"),
        interactive=max_prompt is not None or max_output is not None,
        end_to_end=_DEFAULT_END_TO_END if end_to_end is None else end_to_end,
        queue_timeout=queue_timeout if table.ok("queue_timeout") else None,
    )
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
        prompt_bound=prompt_bound,
        objective=objective,
        kinds=kinds,
    )


def _kinds(table: Table, *, report: bool = False) -> frozenset[str]:
    """The request kinds a class takes (``kinds``; left out, the generating ones); ``report``: say what is wrong with the key."""
    if not table.has("kinds"):
        return GENERATION_KINDS
    given = table.array("kinds", "a list of request kinds") if report else table.peek("kinds")
    if not isinstance(given, list) or not given:
        if report and table.ok("kinds"):
            table.problem("kinds", f"must be a non-empty list of {', '.join(REQUEST_KINDS)}")
        return frozenset()
    unknown = [describe(kind) for kind in given if kind not in REQUEST_KINDS]
    if unknown:
        if report:
            table.problem("kinds", f"{', '.join(unknown)} is not a request kind (kinds: {', '.join(REQUEST_KINDS)})")
        return frozenset()
    return frozenset(str(kind) for kind in given)
