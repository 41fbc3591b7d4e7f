"""tailguard config files for the benchmarks: two pools (interactive, batch) of endpoints on this host, the shipped classes."""

from __future__ import annotations

from collections.abc import Sequence
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
    lines = [
        "[server]",
        f'http_listen = "{HOST}:{http_port}"',
        f'grpc_listen = "{HOST}:{grpc_port}"',
        "reload_poll_interval = 0",
        "",
        *sections,
    ]
    for pool in (interactive, batch):
        lines += pool.toml()
    lines += [
        "[classes.interactive]",
        f'pool = "{interactive.name}"',
        "max_prompt_tokens = 500",
        "max_output_tokens = 128",
        "queue_timeout = 3.0",
        "priority = 0",
        "",
        "[classes.batch]",
        f'pool = "{batch.name}"',
        f"queue_timeout = {batch_queue_timeout}",
        "priority = 1",
        "",
    ]
    return "\n".join(lines)
