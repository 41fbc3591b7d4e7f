"""The peer router the overhead drivers measure beside tailguard: vllm-router, found, started and named."""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from pathlib import Path

from bench.harness.client import HOST

# The cheapest of the peer's policies, so its cost is a floor; its default,
# cache_aware, also walks a prefix tree per request.
PEER_POLICY = "round_robin"


def peer_command(exe: Path, port: int, metrics_port: int, engine_port: int) -> list[str]:
    """vllm-router in front of one engine, on 127.0.0.1 only (its metrics too), its defaults otherwise."""
    return [
        str(exe),
        "--host", HOST,
        "--port", str(port),
        "--worker-urls", f"http://{HOST}:{engine_port}",
        "--policy", PEER_POLICY,
        "--prometheus-host", HOST,
        "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip


def find_peer() -> Path | None:
    """The vllm-router beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return beside
    found = shutil.which("vllm-router")
    return Path(found) if found else None


def peer_version(peer: Path | None) -> str | None:
    if peer is None:
        return None
    try:
        version = importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return f"vllm-router {version} ({peer}), --policy {PEER_POLICY}, its defaults otherwise"
