"""The validated configuration: frozen, typed, and complete (defaults filled in).

``router.config.load_config`` builds a :class:`Config` from ``config.toml``;
everything downstream reads only these objects, never raw TOML.
Durations are seconds (``*_timeout``); sizes are tokens unless named bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OverCapMode = Literal["clamp", "reject"]
SimulateProfile = Literal["latency", "throughput", "instant"]


@dataclass(frozen=True)
class ServerConfig:
    """Where the process listens and how it guards its front door."""

    http_host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_body_bytes: int = 4 * 1024 * 1024
    reload_poll_interval: float = 1.0  # seconds between config file mtime checks; 0 = off


@dataclass(frozen=True)
class EstimateConfig:
    """How the router estimates prompt tokens without a tokenizer."""

    chars_per_token: float = 4.0  # non-CJK characters per token
    cjk_chars_per_token: float = 1.0  # CJK characters per token
    per_message_tokens: int = 4  # chat template overhead per message


@dataclass(frozen=True)
class LimitsConfig:
    """Caps on request size, as callers see them (also served at /v1/limits)."""

    input_cap_tokens: int = 8192  # estimated prompt tokens above this -> 413
    default_max_tokens: int = 256  # when the request sets none
    output_cap_tokens: int = 1024  # max_tokens above this is clamped or rejected
    over_cap: OverCapMode = "clamp"


@dataclass(frozen=True)
class TimeoutsConfig:
    """Deadlines and intervals, layered: queue deadline < end-to-end timeout."""

    connect_timeout: float = 2.0
    end_to_end_timeout: float = 120.0
    health_check_interval: float = 2.0
    health_check_timeout: float = 1.0
    retry_after: float = 1.0  # Retry-After hint when nothing better is known


@dataclass(frozen=True)
class EndpointConfig:
    """One inference server (one GPU or one vLLM instance)."""

    url: str  # base URL without /v1, e.g. http://127.0.0.1:8001
    max_concurrency: int


@dataclass(frozen=True)
class PoolConfig:
    """A group of endpoints tuned alike, with a strict concurrency cap and a queue."""

    name: str
    endpoints: tuple[EndpointConfig, ...]
    max_concurrency: int  # across all endpoints of the pool
    max_queue: int  # requests allowed to wait; one more -> 429
    max_model_len: int  # prompt + max_tokens must fit
    models: tuple[str, ...]  # served model names; the first is the default
    simulate_profile: SimulateProfile = "latency"  # engine profile under --simulate


@dataclass(frozen=True)
class ClassConfig:
    """A request class: which pool, how long it may queue, how urgent it is.

    A request falls in the first class (in file order) whose thresholds both
    admit it; ``None`` means no limit. The last class must have no thresholds.
    """

    name: str
    pool: str
    queue_timeout: float
    priority: int  # lower is served first when classes share a pool
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``digest`` is a hash of the source text."""

    server: ServerConfig
    estimate: EstimateConfig
    limits: LimitsConfig
    timeouts: TimeoutsConfig
    pools: tuple[PoolConfig, ...]
    classes: tuple[ClassConfig, ...]
    digest: str = ""

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
