"""tailguard's config for a retry set-up: one pool of one engine, one class, the hint computed or fixed."""

from __future__ import annotations

from bench.harness.config import PoolSpec, one_class, pools_table, server_table
from bench.harness.toml import TomlTable, dumps, merged
from bench.retry.model import RETRY_AFTER_S, Options

POOL = "interactive"


def router_config(http_port: int, grpc_port: int, engine_port: int, options: Options, *, hint: str) -> str:
    """A config.toml: the pool's seats = the engine's, ``retry_after_hint = HINT`` over ``retry_after``, the class's deadline in real s."""
    pool = PoolSpec(POOL, [(engine_port, options.seats)], options.seats, options.max_queue)
    timeouts: TomlTable = {"timeouts": {"retry_after": RETRY_AFTER_S, "retry_after_hint": hint}}
    classes = one_class(POOL, options.queue_timeout_gpu * options.time_scale)
    return dumps(merged(server_table(http_port, grpc_port), timeouts, pools_table(pool), classes))
