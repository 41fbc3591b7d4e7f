"""tailguard as its users run it: ``tailguard serve`` in a process of its own, over real engines.

The config is a file, reloads are SIGHUP, the access log is read back from
the JSON lines the process writes: what a test sees is what an operator sees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.vllm.engines import free_port

START_TIMEOUT = 30.0


@dataclass
class Tailguard:
    """A running ``tailguard serve``: where it listens, its config file and its log."""

    url: str
    grpc_target: str | None
    config_path: Path
    log_path: Path
    process: subprocess.Popen[bytes]

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
        return lines

    def access(self, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """The access line of ``request_id`` (written once the request ended), waited for."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_lines():
                if line.get("logger") == "tailguard.access" and line.get("request_id") == request_id:
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no access line for {request_id}")
            time.sleep(0.05)

    def access_lines(self) -> list[dict[str, Any]]:
        return [line for line in self.log_lines() if line.get("logger") == "tailguard.access"]

    def reload(self, config_text: str, timeout: float = 10.0) -> None:
        """Write the new config and SIGHUP; returns once the process logged that it applied it."""
        before = sum(1 for line in self.log_lines() if "reload" in str(line.get("msg", "")))
        self.config_path.write_text(config_text)
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while sum(1 for line in self.log_lines() if "reload" in str(line.get("msg", ""))) <= before:
            if time.monotonic() > deadline:
                raise AssertionError("the reload was not logged")
            time.sleep(0.05)

    def health(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=5).json()
        return answer

    def wait_endpoints(self, state: str, count: int, timeout: float = 20.0) -> None:
        """Until ``count`` endpoints of all pools are in ``state`` ("up", "down", ...) on ``/health``."""
        deadline = time.monotonic() + timeout
        while True:
            states = [s for pool in self.health().get("pools", {}).values() for s in pool.get("endpoints", {}).values()]
            if states.count(state) >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"endpoints {states}, waited for {count} {state}")
            time.sleep(0.1)


@contextmanager
def run_tailguard(config_text: str, work_dir: Path, *, env: dict[str, str] | None = None, grpc: bool = False) -> Iterator[Tailguard]:
    """Start ``tailguard serve`` on free ports with ``config_text``; stops it (SIGTERM, then SIGKILL) on exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.toml"
    config_path.write_text(config_text)
    log_path = work_dir / "tailguard.log"
    port = free_port()
    argv = [sys.executable, "-m", "tailguard.server", "serve", "--config", str(config_path), "--http-listen", f"127.0.0.1:{port}", "--log-format", "json"]
    grpc_target = None
    if grpc:
        grpc_target = f"127.0.0.1:{free_port()}"
        argv += ["--grpc-listen", grpc_target]
    else:
        argv.append("--no-grpc")
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    running = Tailguard(f"http://127.0.0.1:{port}", grpc_target, config_path, log_path, process)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tailguard exited ({process.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                httpx.get(f"{running.url}/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tailguard did not listen:\n{log_path.read_text()[-3000:]}") from None
                time.sleep(0.1)
        yield running
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(60)  # a stalled host can take seconds to end even a killed process
