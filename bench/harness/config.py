"""tailguard config files for the benchmarks: two pools (interactive, batch) of endpoints on this host, the shipped classes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.harness.client import HOST


@dataclass(frozen=True)
class PoolSpec:
    """One [pools.NAME] of a generated tailguard config."""

    name: str
    endpoints: Sequence[tuple[int, int]]  # (port, max_concurrency)
    max_concurrency: int
    max_queue: int
    extra: Sequence[str] = ()  # more "key = value" lines of the pool's table

    def toml(self) -> list[str]:
        """The pool's table, as config.toml lines (endpoints on this host)."""
        endpoints = ", ".join(f'{{ url = "http://{HOST}:{port}", max_concurrency = {cap} }}' for port, cap in self.endpoints)
        return [
            f"[pools.{self.name}]",
            f"max_concurrency = {self.max_concurrency}",
            f"max_queue = {self.max_queue}",
            "max_model_len = 32768",
            'models = ["sim-llama-3.1-8b"]',
            *self.extra,
            f"endpoints = [{endpoints}]",
            "",
        ]


def tailguard_config(
    http_port: int,
    grpc_port: int,
    interactive: PoolSpec,
    batch: PoolSpec,
    *,
    batch_queue_timeout: float = 30.0,
    sections: Sequence[str] = (),
) -> str:
    """A config.toml: the shipped classes (interactive <= 500 prompt / 128 output tokens, batch the rest).

    ``sections`` are more tables (lines) put after ``[server]``.
    """
    lines = [*server_table(http_port, grpc_port), *sections]
    for pool in (interactive, batch):
        lines += pool.toml()
    lines += classes_tables({"interactive": interactive.name, "batch": batch.name}, {"interactive": "3.0", "batch": f"{batch_queue_timeout}"})
    return "\n".join(lines)


def server_table(http_port: int, grpc_port: int) -> list[str]:
    """``[server]``: both listeners on this host, no reload polling (a benchmark's config does not change under it)."""
    return [
        "[server]",
        f'http_listen = "{HOST}:{http_port}"',
        f'grpc_listen = "{HOST}:{grpc_port}"',
        "reload_poll_interval = 0",
        "",
    ]


def classes_tables(
    pools: Mapping[str, str], queue_timeouts: Mapping[str, str], relay_intervals: Mapping[str, float] | None = None
) -> list[str]:
    """The shipped classes: interactive (<= 500 prompt / 128 output tokens, priority 0) and batch (the rest, priority 1).

    ``pools`` names each class's pool; ``queue_timeouts`` are written as given
    (the callers' committed configs spell them differently: ``3.0``, ``1.5``);
    a class in ``relay_intervals`` gets that ``relay_interval`` (seconds).
    """
    thresholds = {"interactive": ["max_prompt_tokens = 500", "max_output_tokens = 128"], "batch": []}
    lines: list[str] = []
    for priority, name in enumerate(("interactive", "batch")):
        lines += [f"[classes.{name}]", f'pool = "{pools[name]}"', *thresholds[name]]
        lines += [f"queue_timeout = {queue_timeouts[name]}", f"priority = {priority}"]
        if relay_intervals and name in relay_intervals:
            lines.append(f"relay_interval = {relay_intervals[name]:g}")
        lines.append("")
    return lines
