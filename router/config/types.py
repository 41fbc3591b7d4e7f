"""The validated configuration: frozen, typed, and complete (defaults filled in).

``router.config.load.load_config`` builds a :class:`Config` from ``config.toml``;
everything downstream reads only these objects, never raw TOML.
Durations are seconds (``*_timeout``); sizes are tokens unless named bytes.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from typing import Literal

OverCapMode = Literal["clamp", "reject"]
SimulateProfile = Literal["latency", "throughput", "instant"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LogFormat = Literal["json", "text"]
HealthCheckKind = Literal["auto", "http", "completion"]


@dataclass(frozen=True)
class TlsConfig:
    """One listener's TLS (``[server.http_tls]``, ``[server.grpc_tls]``): PEM files, read when loaded.

    ``fingerprint`` is a hash of the three files' bytes as the config check
    read them, so a rotated certificate makes a different config and a
    reload applies it; never shown.
    """

    cert_file: str  # the certificate chain, leaf first
    key_file: str  # its private key, unencrypted
    client_ca_file: str | None = None  # set: a client must present a certificate this CA signed (mTLS)
    fingerprint: str = field(default="", repr=False)

    @property
    def files(self) -> tuple[str, ...]:
        """The files a reload watches for a change."""
        return (self.cert_file, self.key_file) + (() if self.client_ca_file is None else (self.client_ca_file,))


@dataclass(frozen=True)
class ServerConfig:
    """Where the process listens and how it guards its front door."""

    http_host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_body_bytes: int = 4 * 1024 * 1024
    # Completion calls the gRPC front end holds open at once; one more gets
    # RESOURCE_EXHAUSTED with a retry hint at once (never a silent CANCELLED).
    grpc_max_calls: int = 1000
    # A backend's non-streaming body larger than this is not read on: the
    # caller gets 502. Far above any real completion. (Error bodies and probe
    # answers are read to 64 KiB, no further.)
    max_backend_body_bytes: int = 16 * 1024 * 1024
    reload_poll_interval: float = 1.0  # seconds between config file mtime checks; 0 = off
    # The HTTP/1.1 server under the OpenAI API is tailguard's own (llhttp on Trio),
    # the only one: a file may still say so ("lean"); any other value is refused
    # (config.sections). The guards below bound it.
    http_server: Literal["lean"] = "lean"
    max_header_bytes: int = 64 * 1024  # request line + headers; more -> 431 and close
    header_timeout: float = 10.0  # a request's head must arrive within this -> else 408 and close
    body_timeout: float = 30.0  # its body within this after the head -> else 408 and close
    keep_alive_timeout: float = 75.0  # an idle keep-alive connection is closed after this
    write_timeout: float = 30.0  # one write to a client that cannot complete in this closes it
    max_connections: int = 10_000  # open HTTP connections; one more is answered 503 and closed
    # Processes serving the same ports (SO_REUSEPORT), under one supervisor;
    # more than 1 shares every cap through [cluster] (a local redis-server
    # is started when the file has no [cluster]). Needs a restart.
    workers: int = 1
    # TLS on each listener, or None (plain TCP); each its own, as the callers of
    # each differ (web apps over HTTP, internal services over gRPC, often mTLS).
    http_tls: TlsConfig | None = None
    grpc_tls: TlsConfig | None = None
    # A listener of its own for GET /metrics (host, port), which the API's listener then no
    # longer serves: Prometheus reaches it, the API's callers need not. None: /metrics is on the API's.
    metrics_listen: tuple[str, int] | None = None
    # The request header (and gRPC metadata key) whose value pins a conversation's
    # prefix key (router/admission/prefix_keys.py), lower case; "" reads none. Takes effect on reload.
    session_header: str = "x-session-id"


@dataclass(frozen=True)
class EstimateConfig:
    """How the router estimates prompt tokens without a tokenizer."""

    chars_per_token: float = 4.0  # non-CJK UTF-8 bytes per token (for ASCII, characters)
    cjk_chars_per_token: float = 1.0  # CJK characters per token
    per_message_tokens: int = 4  # chat template overhead per message
    # Learn each model's real/estimated ratio per kind of text from the engines' usage (router/admission/prompt_ratios.py).
    learn: bool = True
    learn_window: int = 128  # the last this many ratios of a model and kind
    learn_quantile: float = 0.95  # the ratio applied: this quantile of the window
    learn_after: int = 8  # observations of a kind before its ratio applies
    max_ratio: float = 8.0  # the most a learnt ratio multiplies a kind's estimate by


@dataclass(frozen=True)
class LimitsConfig:
    """Caps on request size, as callers see them (also served at /v1/limits)."""

    input_cap_tokens: int = 8192  # estimated prompt tokens above this -> 400 context_length_exceeded
    default_max_tokens: int = 256  # when the request sets none
    output_cap_tokens: int = 1024  # max_tokens above this is clamped or rejected
    over_cap: OverCapMode = "clamp"
    # The most sequences one request may ask the engine to run (``n``; ``best_of`` where an engine takes it):
    # each is a seat and max_tokens of output, counted as such (router/admission/admit.py); above it -> 400.
    max_n: int = 8
    # The budgets of callers without a key (auth off): tokens (estimated prompt + max_tokens, reserved at
    # admission, settled to the real usage) and requests admitted in any 60 s (router/quotas/budgets.py). None: none.
    anonymous_tokens_per_minute: int | None = None
    anonymous_requests_per_minute: int | None = None


@dataclass(frozen=True)
class TimeoutsConfig:
    """Deadlines and intervals, layered: queue deadline < end-to-end < front proxy."""

    connect_timeout: float = 2.0
    # A kept-alive connection to an engine idle this long is closed, not
    # reused: below the engine's own idle timeout (vLLM's uvicorn: 5 s), so a
    # request is never written into a connection the engine is closing.
    backend_keep_alive_timeout: float = 4.0
    end_to_end_timeout: float = 120.0
    health_check_interval: float = 2.0
    health_check_timeout: float = 1.0
    retry_after: float = 1.0  # Retry-After hint when nothing better is known; the floor of a computed one
    # "computed": queue refusals and no_backend say when a seat or an endpoint is expected (router/queueing/retry_hint.py);
    # "fixed": every hint is retry_after, as before.
    retry_after_hint: RetryAfterHint = "computed"
    # The read timeout of the proxy in front (nginx proxy_read_timeout), if known:
    # only checked against end_to_end_timeout, to warn; tailguard never enforces it.
    front_proxy_timeout: float | None = None
    drain_timeout: float = 30.0  # on SIGTERM, time in-flight requests get before cancellation


@dataclass(frozen=True)
class ApiKeyConfig:
    """One API key: who holds it and what it may do.

    Only the key's SHA-256 hex digest is kept, never the key; it stays out of
    ``repr`` all the same, so a logged config shows no credential material.
    """

    name: str  # the caller's name in logs and metrics
    sha256: str = field(repr=False)  # lower-case hex digest of the key
    may_force_classes: frozenset[str] = frozenset()  # classes this caller may ask for
    max_concurrency: int | None = None  # its requests in flight at most; None = no cap
    # Its share of a pool's seats against other callers waiting at the same priority (router/queueing/fair_share.py):
    # tokens served in proportion to the weights. Default 1.
    weight: float = 1.0
    # Its budgets over any 60 s: tokens (estimated prompt + max_tokens reserved at admission, settled to
    # the real usage at the end) and requests (router/quotas/budgets.py). None: no budget.
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True)
class AuthConfig:
    """API keys; with none, auth is off and every caller is anonymous."""

    keys: tuple[ApiKeyConfig, ...] = ()
    keys_file: str | None = None  # the keys file read (a path, not a secret), if any

    @property
    def enabled(self) -> bool:
        return bool(self.keys)


@dataclass(frozen=True)
class LoggingConfig:
    """What the process logs and in which shape."""

    level: LogLevel = "INFO"
    format: LogFormat = "json"  # json: one object a line, for a log pipeline
    access_log: bool = True  # one line per finished request
    log_prompts: bool = False  # access log lines may carry the prompt text


@dataclass(frozen=True)
class MetricsConfig:
    """How the router observes its backends and its callers."""

    backend_scrape_interval: float = 5.0  # seconds between scrapes of vLLM /metrics; 0 = off
    # seconds: a caller-supplied x-request-id seen again within it counts as a retry; 0 = off
    duplicate_request_id_window: float = 10.0
    # Callers with tailguard_caller_* series of their own (the busiest); the rest are summed as one.
    caller_series: int = 100
    # GET /metrics needs "Authorization: Bearer <token>" of this digest (the token read from
    # the environment variable token_env); None: /metrics is open, as before.
    token_env: str | None = None
    token_sha256: str | None = field(default=None, repr=False)  # as ApiKeyConfig.sha256: no credential material in a logged config


@dataclass(frozen=True)
class TracingConfig:
    """``[tracing]``: an OpenTelemetry trace of every request, exported over OTLP/HTTP. Off by default.

    ``headers`` go with every export (a collector's or vendor's credentials:
    check-config and the reload summary show their names, never their values).
    """

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # the OTLP/HTTP traces URL, path included
    sample_ratio: float = 1.0  # of the traces this process starts; a caller's traceparent decides for its own
    service_name: str = "tailguard"
    headers: tuple[tuple[str, str], ...] = ()


RebalanceMode = Literal["auto", "off"]
LendWhen = Literal["full", "busier"]  # LendConfig.when
QueueOrder = Literal["fair", "arrival"]  # PoolConfig.queue_order
RetryAfterHint = Literal["computed", "fixed"]  # TimeoutsConfig.retry_after_hint


@dataclass(frozen=True)
class RebalanceConfig:
    """When movable endpoints change pools on their own (``[rebalance]``).

    A pool's utilisation is its classes' demand (seats held, their own or
    borrowed, plus requests waiting in the router and in vLLM) over its
    seats. When one pool's stays above another's by ``threshold`` for
    ``hold_time`` seconds, a movable endpoint of the other moves to it:
    it takes no new requests of its old pool, finishes its running ones,
    then joins. No move within ``cooldown`` of the last, and none that the
    reverse move would undo at once: assignments do not flap.

    ``seat_step`` below 1 moves seats, not whole engines: a move takes
    ``ceil(seat_step x the engine's cap)`` seats of one movable engine into a
    share of it serving the busy pool (router/fleet/seat_split.py), so a split of
    2 or 4 engines can be 1.2 : 2.8.
    """

    interval: float = 1.0  # seconds between looks at the pools' demand
    hold_time: float = 30.0  # an imbalance must last this long before a move
    threshold: float = 0.3  # utilisation difference that counts as imbalance
    cooldown: float = 60.0  # seconds after a move before the next
    seat_step: float = 1.0  # share of an engine's seats one move takes, in (0, 1]; 1: the whole engine

    def step_seats(self, engine_cap: int) -> int:
        """Seats one move takes of an engine of ``engine_cap`` seats (at least one)."""
        return max(1, math.ceil(round(self.seat_step * engine_cap, 9)))  # 0.1 x 30 is 3, not 4


@dataclass(frozen=True)
class BackendAccess:
    """How tailguard itself reaches an engine: its own API key and the CA it trusts.

    vLLM started with ``--api-key`` guards every ``/v1/*`` route; the key
    sent there is tailguard's, never a caller's (a caller's ``Authorization``
    header stops at tailguard). ``api_key`` is the value of the environment
    variable ``api_key_env``, read when the file is (re)loaded; it stays out
    of ``repr`` so a logged config shows no credential.
    """

    api_key_env: str | None = None  # the variable's name (check-config shows it, never the value)
    api_key: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None  # a PEM bundle for https:// engines; None: the system's roots

    @property
    def authorization(self) -> dict[str, str]:
        """The header tailguard's calls to ``/v1/*`` carry (none without a key)."""
        return {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}


@dataclass(frozen=True)
class EndpointConfig:
    """One inference server (one GPU or one vLLM instance)."""

    url: str  # base URL without /v1, e.g. http://127.0.0.1:8001
    max_concurrency: int
    movable: bool = False  # may move to another pool when demand says so ([rebalance])
    access: BackendAccess = BackendAccess()  # the pool's, or this entry's own api_key_env


DnsScheme = Literal["http", "https"]


@dataclass(frozen=True)
class DnsEndpointsConfig:
    """Endpoints named by DNS (a Kubernetes headless Service), kept current by router/fleet/discovery.py.

    Every A and AAAA address of ``name`` is one endpoint,
    ``scheme://address:port``, with ``max_concurrency`` seats of its own.
    """

    name: str  # e.g. vllm-latency.default.svc.cluster.local
    port: int
    max_concurrency: int  # each address's cap
    scheme: DnsScheme = "http"
    access: BackendAccess = BackendAccess()  # the pool's, or this entry's own api_key_env

    @property
    def key(self) -> tuple[str, int, str]:
        """What a reload matches on: the same name, port and scheme are the same source."""
        return (self.name.lower().rstrip("."), self.port, self.scheme)

    def endpoint(self, address: str) -> EndpointConfig:
        """The endpoint of one resolved address (an IPv4 or IPv6 literal)."""
        host = f"[{address}]" if ":" in address else address
        return EndpointConfig(url=f"{self.scheme}://{host}:{self.port}", max_concurrency=self.max_concurrency, access=self.access)


@dataclass(frozen=True)
class DiscoveryConfig:
    """``[discovery]``: how pools' ``endpoints_dns`` are resolved.

    Every ``interval`` seconds (and at once on a reload) each name is
    resolved for A and AAAA records; a failed or empty answer keeps the last
    good set, so a DNS outage never empties a pool.
    """

    interval: float = 10.0  # seconds between resolutions
    timeout: float = 2.0  # one name's A and AAAA queries give up after this
    nameserver: str | None = None  # an IP address; None: the system's resolver (/etc/resolv.conf)
    nameserver_port: int = 53


@dataclass(frozen=True)
class OutlierDetectionConfig:
    """When live failures take an endpoint out of a pool for a while (Envoy's words).

    ``consecutive_failures`` failed requests in a row (connect failures,
    resets, 5xx, first-byte timeouts, broken replies) eject the endpoint for
    ``base_ejection_time`` times the number of times it was ejected, at most
    ``max_ejection_time``. Outlier detection alone never ejects more than
    ``max_ejection_percent`` of the pool's endpoints (rounded down): below
    100, the only endpoint of a pool is taken out by its health check, never
    by requests that clients may have made fail on purpose.
    """

    consecutive_failures: int = 5
    base_ejection_time: float = 5.0
    max_ejection_time: float = 300.0
    max_ejection_percent: float = 50.0
    # The failure-ratio rule, for an engine that fails often but never 5 in a
    # row: ejected when at least ``failure_ratio`` of its last
    # ``failure_window`` requests failed (once it has ``failure_min_requests``
    # of them) while the rest of the pool failed at most half as often.
    failure_ratio: float = 0.1
    failure_window: int = 50
    failure_min_requests: int = 20


PlacementMode = Literal["prefix_affinity", "least_loaded"]
# What a class's max_prompt_tokens bounds: every prompt token, or those the engine is expected to prefill
# (a warm conversation's history on its home engine is cached: router/admission/prefix_memory.py).
PromptBound = Literal["all", "uncached"]

# What a request asks of an engine, by the route it came in on: four APIs that generate tokens, and the
# pooling routes (embeddings, rerank) that only prefill. A class takes the kinds its ``kinds`` names;
# left out, the generating ones.
GENERATION_KINDS: frozenset[str] = frozenset({"chat", "completion", "responses", "messages"})
POOLING_KINDS: frozenset[str] = frozenset({"embeddings", "rerank"})
REQUEST_KINDS: tuple[str, ...] = ("chat", "completion", "responses", "messages", "embeddings", "rerank")
CacheSaltMode = Literal["none", "caller"]


@dataclass(frozen=True)
class PlacementConfig:
    """How a pool picks the endpoint a seat goes to (router/fleet/policies.py; docs/pools.md, "Placement")."""

    # "prefix_affinity": a request's prefix key picks its home engine (rendezvous
    # hashing within a load bound); "least_loaded": load alone.
    mode: PlacementMode = "prefix_affinity"
    # The bound: an endpoint may take a keyed request while its load after it
    # stays within ceil(load_factor x the pool's mean); >= 1.
    load_factor: float = 1.1
    blocks: int = 16  # leading 16-token blocks of the prompt the key covers
    # "caller": the body sent to vLLM carries a cache_salt digest of the caller's
    # identity, so callers never share cached prefixes (nor time their hits).
    cache_salt: CacheSaltMode = "none"


@dataclass(frozen=True)
class LendConfig:
    """Idle seats a pool lends to other pools' requests (work conservation).

    A borrowed seat is the lender's: it counts against the lender's caps, is
    returned the moment its request ends, and is lent only while none of the
    lender's own requests waits, so the lender's own class always gets the
    next free seat. What a borrower may bring is bounded: a long prefill on a
    latency engine stalls every request running there.
    """

    to: tuple[str, ...] = ()  # pools whose requests may borrow here; () lends nothing
    max_seats: int | None = None  # lent at once at most; None: any above the reserve
    reserve: int = 0  # seats kept free for the pool's own requests
    max_prompt_tokens: int | None = None  # a borrower's estimated prompt must fit (the prefill stall)
    max_output_tokens: int | None = None  # and its max_tokens (how long the seat is away)
    # Borrowed requests still in prefill (no first byte yet) at once per endpoint: with chunked
    # prefill each adds at most one chunk to a step, whatever its length. None: no bound (as
    # before the key existed, so a file without it lends as it did); the shipped file sets 1.
    prefills: int | None = None
    # When a borrower may take a seat here: "full" only once its own pool has no seat free (as before
    # the key existed); "busier" also while its least-filled endpoint is fuller (in flight over
    # max_concurrency) than this pool's would be with the borrowed request and the reserve, because
    # an engine runs slower with every sequence it holds, and a free seat is not an idle engine.
    when: LendWhen = "full"
    # Seconds: while the lender's own streamed requests on an endpoint lately waited longer than this
    # from seat to first byte (router/fleet/lender_latency.py), that endpoint takes no new borrowed request.
    # None: no such bound.
    ttft_budget: float | None = None
    # Share of seats: while the borrower's least busy endpoint is fuller than this pool's would be by
    # more than this, max_prompt_tokens does not bind. A split so uneven costs the borrower's requests
    # more in slow steps than a long prompt here costs this pool's; how uneven it gets depends on the
    # fleet (two engines 1:1 cannot absorb what four 1:3 can). None: the bound always binds.
    max_imbalance: float | None = None

    @property
    def stall_bounds(self) -> bool:
        """Any of the expert stall bounds is set: they govern lending, as written, instead of the lender's objective."""
        return any(bound is not None for bound in (self.prefills, self.ttft_budget, self.max_prompt_tokens, self.max_imbalance))


@dataclass(frozen=True)
class PoolConfig:
    """A group of endpoints tuned alike, with a strict concurrency cap and a queue."""

    name: str
    endpoints: tuple[EndpointConfig, ...]
    # across all endpoints of the pool; when the file leaves it out, the sum
    # of its endpoints' caps (required with endpoints_dns or no endpoints)
    max_concurrency: int
    max_queue: int  # requests allowed to wait; one more -> 429. Left out: 4 x max_concurrency
    # prompt + max_tokens must fit; when the file leaves it out, the smallest
    # value the pool's endpoints report (router/fleet/model_len.py), 0 until asked
    max_model_len: int
    models: tuple[str, ...]  # served model names; the first is the default
    simulate_profile: SimulateProfile = "latency"  # engine profile under --simulate
    # Refuse at arrival a request whose expected wait (from the pool's measured
    # drain rate) is over this fraction of the time its class may queue; 0 = off.
    fail_fast_fraction: float = 1.0
    # Within a priority: "fair", callers (API keys; anonymous ones as one) in shares of the tokens served
    # (router/queueing/fair_share.py); "arrival", first come first served across callers.
    queue_order: QueueOrder = "fair"
    # Streams only: seconds from sending a request to the stream's first event;
    # past it the call fails (counts for outlier detection) and is retried
    # elsewhere once. (vLLM sends a non-streaming body only when generation
    # ends: the end-to-end deadline bounds those.)
    first_byte_timeout: float = 60.0
    # "http": GET /health; "completion": a one-token completion every turn,
    # which also catches an engine that answers /health but hangs on work;
    # "auto": GET /health, and the completion only in a turn where a call has
    # waited a whole interval for its first byte and the engine sent nothing
    # meanwhile (router/upkeep.py; docs/operations.md has the costs).
    health_check: HealthCheckKind = "auto"
    # Probes in a row that must fail before an endpoint is marked down, and
    # pass before it is up again (Envoy's unhealthy_threshold / healthy_threshold).
    unhealthy_threshold: int = 3
    healthy_threshold: int = 1
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    lend: LendConfig = LendConfig()
    # Seats of this pool one class may hold at once (a shared engine keeps
    # room for the others): (class, seats) pairs; classes not named: no limit.
    class_max_concurrency: tuple[tuple[str, int], ...] = ()
    # Send each request's class priority as vLLM's ``priority`` field (the
    # pool's engines run ``--scheduling-policy priority``; lower runs first).
    vllm_priority: bool = False
    # Ask vLLM for a stream even when the caller wants a whole answer, and put
    # the answer together here: non-streaming requests then have a first byte
    # (first_byte_timeout bounds a hung engine, the access log a real TTFT).
    stream_upstream: bool = False
    # "off": its movable endpoints stay, and none moves in.
    rebalance: RebalanceMode = "auto"
    placement: PlacementConfig = PlacementConfig()
    # Endpoints from DNS, beside ``endpoints``; ``max_concurrency`` stays the
    # pool's cap whatever the number of addresses (their caps' sum may be less).
    endpoints_dns: tuple[DnsEndpointsConfig, ...] = ()
    # False: max_model_len was left out of the file and is asked of the
    # endpoints (GET /v1/models) at start and on every reload; an endpoint
    # then serves the pool only once it has reported at least that much.
    max_model_len_configured: bool = True
    # tailguard's own key for the pool's engines (api_key_env) and the CA of
    # https:// ones; each endpoint entry carries its effective copy.
    access: BackendAccess = BackendAccess()

    def class_limit(self, name: str) -> int | None:
        """The seats class ``name`` may hold in this pool at once, or None."""
        for klass, seats in self.class_max_concurrency:
            if klass == name:
                return seats
        return None


@dataclass(frozen=True)
class ObjectiveConfig:
    """What a class is promised (``[classes.NAME.objective]``): attainment measures it, and lending keeps the lender's ttft (router/fleet/lending.py).

    A request meets its class's objective when every target stated here held
    for it: its first token within ``ttft``, its output tokens after the first
    at ``itl`` seconds each or faster (the mean over its stream), and its end
    within ``e2e``. The class is on target while at least ``percentile`` per
    cent of its requests meet it. ``None`` (0 in the file): no such target.
    ``throughput_share``: the share of the fleet's output tokens a batch class
    is promised while it has work (0: none promised).
    """

    ttft: float | None
    itl: float | None
    e2e: float
    percentile: float = 99.0
    throughput_share: float = 0.0


@dataclass(frozen=True)
class ClassConfig:
    """A request class: which pool, how long it may queue, how urgent it is.

    A request falls in the first class (in file order) whose thresholds both
    admit it; ``None`` means no limit. The last class must have no thresholds.
    """

    name: str
    pool: str
    queue_timeout: float
    priority: int  # lower is served first when classes share a pool; left out: its place in file order
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    # Streams of this class are read from the backend at most once per this
    # many seconds (0: each event as it comes): the events of a step pile up
    # and go on in one read and one send, for a class that does not watch
    # tokens arrive (batch jobs), so the event loop stays free for the ones
    # that do.
    relay_interval: float = 0.0
    # "uncached": max_prompt_tokens bounds the tokens expected to need prefill
    # (all of them when the router cannot know); "all": every prompt token.
    prompt_bound: PromptBound = "all"
    # Left out of the file: router/config/objectives.py's defaults (a class with thresholds: interactive ones).
    objective: ObjectiveConfig = ObjectiveConfig(ttft=None, itl=None, e2e=120.0)
    # The request kinds it takes (REQUEST_KINDS): embeddings and rerank have no decode, so they get a class
    # of their own rather than waiting behind generations or counting as long jobs.
    kinds: frozenset[str] = GENERATION_KINDS


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: one admission budget shared by every replica, on Redis (router/quotas/ledger.py)."""

    redis_url: str  # redis://host:port/db
    namespace: str = "tailguard"  # key prefix: replicas that share caps share it
    replica_id: str = ""  # empty: host name and process id
    lease_ttl: float = 5.0  # a replica silent this long has its seats returned to the others
    sync_interval: float = 0.1  # seconds between syncs with the ledger
    static_share: float = 0.5  # share of each cap used while the ledger is unreachable
    block: int = 2  # spare seats held beyond demand, so a burst needs no round trip

    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Config:
    """The whole configuration.

    ``digest`` is a hash of the source text and, when auth is on, of the
    resolved keys (digests, names, rights): a key rotated in the keys file or
    the environment changes it, so a reload applies the rotation.
    ``warnings`` are problems that do not stop the process (e.g. timeout
    layers broken outside tailguard); they are shown and logged, not refused.
    """

    server: ServerConfig
    estimate: EstimateConfig
    limits: LimitsConfig
    timeouts: TimeoutsConfig
    pools: tuple[PoolConfig, ...]
    classes: tuple[ClassConfig, ...]
    digest: str = ""
    auth: AuthConfig = AuthConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    cluster: ClusterConfig | None = None  # None: this process holds every cap alone
    tracing: TracingConfig = TracingConfig()
    warnings: tuple[str, ...] = ()

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def class_named(self, name: str) -> ClassConfig:
        for klass in self.classes:
            if klass.name == name:
                return klass
        raise KeyError(name)
