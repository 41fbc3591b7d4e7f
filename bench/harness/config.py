"""tailguard config files for the benchmarks: two pools (interactive, batch) of endpoints on this host, the shipped classes.

Every part is plain data (a TOML table); ``bench.harness.toml`` writes the
document, so a benchmark adds or changes a key by merging a table, never by
editing text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bench.harness.client import HOST
from bench.harness.toml import TomlTable, TomlValue, dumps, merged

MODEL = "sim-llama-3.1-8b"  # the model every generated pool serves, which tailguard names in its body


@dataclass(frozen=True)
class PoolSpec:
    """One [pools.NAME] of a generated tailguard config."""

    name: str
    endpoints: Sequence[tuple[int, int]]  # (port, max_concurrency)
    max_concurrency: int
    max_queue: int
    extra: TomlTable = field(default_factory=dict)  # more keys of the pool's table
    movable: bool = False  # every endpoint ``movable = true``

    def table(self) -> dict[str, TomlValue]:
        """The pool's table (endpoints on this host)."""
        movable: TomlTable = {"movable": True} if self.movable else {}
        endpoints = [{"url": f"http://{HOST}:{port}", "max_concurrency": cap, **movable} for port, cap in self.endpoints]
        own: TomlTable = {"max_concurrency": self.max_concurrency, "max_queue": self.max_queue, "max_model_len": 32768, "models": [MODEL]}
        return {**own, **self.extra, "endpoints": endpoints}


def pools_table(*pools: PoolSpec) -> TomlTable:
    """``[pools.NAME]`` for each of ``pools``, in order."""
    return {"pools": {pool.name: pool.table() for pool in pools}}


def tailguard_config(
    http_port: int,
    grpc_port: int,
    interactive: PoolSpec,
    batch: PoolSpec,
    *,
    batch_queue_timeout: float = 30.0,
    sections: TomlTable = {},  # noqa: B006 - read only
) -> str:
    """A config.toml: the shipped classes (interactive <= 500 prompt / 128 output tokens, batch the rest).

    ``sections`` are more tables, merged after ``[server]`` (a key of theirs under ``server`` joins that table).
    """
    classes = classes_tables({"interactive": interactive.name, "batch": batch.name}, {"interactive": 3.0, "batch": batch_queue_timeout})
    return dumps(merged(server_table(http_port, grpc_port), sections, pools_table(interactive, batch), classes))


def server_table(http_port: int, grpc_port: int) -> TomlTable:
    """``[server]``: both listeners on this host, no reload polling (a benchmark's config does not change under it)."""
    return {"server": {"http_listen": f"{HOST}:{http_port}", "grpc_listen": f"{HOST}:{grpc_port}", "reload_poll_interval": 0}}


def classes_tables(pools: Mapping[str, str], queue_timeouts: Mapping[str, float], relay_intervals: Mapping[str, float] | None = None) -> TomlTable:
    """The shipped classes: interactive (<= 500 prompt / 128 output tokens, priority 0) and batch (the rest, priority 1).

    ``pools`` names each class's pool, ``queue_timeouts`` its queue_timeout
    (s); a class in ``relay_intervals`` gets that ``relay_interval`` (s).
    """
    thresholds: dict[str, TomlTable] = {"interactive": {"max_prompt_tokens": 500, "max_output_tokens": 128}, "batch": {}}
    classes: dict[str, TomlValue] = {}
    for priority, name in enumerate(("interactive", "batch")):
        relay: TomlTable = {"relay_interval": relay_intervals[name]} if relay_intervals and name in relay_intervals else {}
        classes[name] = {"pool": pools[name], **thresholds[name], "queue_timeout": queue_timeouts[name], "priority": priority, **relay}
    return {"classes": classes}


def one_class(pool: str, queue_timeout: float, **more: TomlValue) -> TomlTable:
    """``[classes.POOL]``: the one class of a one-pool config, named for its pool, priority 0."""
    return {"classes": {pool: {"pool": pool, **more, "queue_timeout": queue_timeout, "priority": 0}}}
