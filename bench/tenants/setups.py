"""tailguard's config for a tenants set-up: one pool of one engine, one class, the two tenants' API keys and weights."""

from __future__ import annotations

from collections.abc import Mapping

from bench.harness.config import PoolSpec, one_class, pools_table, server_table
from bench.harness.toml import TomlTable, dumps, merged
from bench.tenants.model import KEYS, Options
from tailguard.router.quotas import hash_key

POOL = "interactive"


def keys_tables(weights: Mapping[str, float]) -> TomlTable:
    """``[[auth.keys]]``: one key a tenant, named for it, its SHA-256 and its weight."""
    return {"auth": {"keys": [{"name": tenant, "key_sha256": hash_key(KEYS[tenant]), "weight": weight} for tenant, weight in weights.items()]}}


def router_config(
    http_port: int, grpc_port: int, engine_port: int, options: Options, *, order: str, weights: Mapping[str, float], queue_timeout: float
) -> str:
    """A config.toml: the pool's seats = the engine's, ``queue_order = ORDER``, the class's ``queue_timeout`` (GPU s) in real s."""
    pool = PoolSpec(POOL, [(engine_port, options.seats)], options.seats, options.max_queue, {"queue_order": order})
    classes = one_class(POOL, queue_timeout * options.time_scale)
    return dumps(merged(server_table(http_port, grpc_port), keys_tables(weights), pools_table(pool), classes))
