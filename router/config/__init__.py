"""Reading ``config.toml`` into the frozen, typed :class:`Config` a reload swaps whole."""

from __future__ import annotations

from .caller_limits import ClassLimits as ClassLimits, Limits as Limits, limits_of as limits_of
from .keys import hash_key as hash_key
from .load import (
    ConfigError as ConfigError,
    limits_document as limits_document,
    load_config as load_config,
    max_model_len_problem as max_model_len_problem,
    parse_config as parse_config,
)
from .pools import normalise_url as normalise_url
from .render import render_config as render_config
from .sections import parse_listen as parse_listen
from .tls import TlsFileError as TlsFileError, read_pem as read_pem, server_context as server_context
from .types import (
    GENERATION_KINDS as GENERATION_KINDS,
    POOLING_KINDS as POOLING_KINDS,
    REQUEST_KINDS as REQUEST_KINDS,
    ApiKeyConfig as ApiKeyConfig,
    AuthConfig as AuthConfig,
    BackendAccess as BackendAccess,
    CacheSaltMode as CacheSaltMode,
    ClassConfig as ClassConfig,
    ClusterConfig as ClusterConfig,
    Config as Config,
    DiscoveryConfig as DiscoveryConfig,
    DnsEndpointsConfig as DnsEndpointsConfig,
    EndpointConfig as EndpointConfig,
    EstimateConfig as EstimateConfig,
    HealthCheckKind as HealthCheckKind,
    LendConfig as LendConfig,
    LimitsConfig as LimitsConfig,
    LoggingConfig as LoggingConfig,
    LogLevel as LogLevel,
    MetricsConfig as MetricsConfig,
    ObjectiveConfig as ObjectiveConfig,
    OutlierDetectionConfig as OutlierDetectionConfig,
    PlacementConfig as PlacementConfig,
    PoolConfig as PoolConfig,
    PromptBound as PromptBound,
    QueueOrder as QueueOrder,
    RebalanceConfig as RebalanceConfig,
    ServerConfig as ServerConfig,
    TimeoutsConfig as TimeoutsConfig,
    TlsConfig as TlsConfig,
    TracingConfig as TracingConfig,
)
