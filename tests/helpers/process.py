"""tailguard as a real process: the shipped config on free ports, ``serve --simulate`` started, waited for and stopped."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port the kernel hands out now (free until someone binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_on_free_ports(tmp_path: Path, ports: Sequence[int] | None = None) -> Path:
    """The shipped config with HTTP, the two engines and gRPC on ``ports`` (free ones by default)."""
    ports = ports or [free_port() for _ in range(4)]
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{ports[0]}").replace(":8001", f":{ports[1]}").replace(":8002", f":{ports[2]}")
    text = text.replace("127.0.0.1:50051", f"127.0.0.1:{ports[3]}")
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


@asynccontextmanager
async def serve_process(
    tmp_path: Path, flags: Sequence[str] = (), http_port: int | None = None
) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient]]:
    """``tailguard serve --simulate`` on free ports, ready (healthy), killed if the test leaves it up."""
    ports = [free_port() for _ in range(4)]
    path = config_on_free_ports(tmp_path, ports)
    process = subprocess.Popen(
        [sys.executable, "-m", "tailguard.server", "serve", "--simulate", "--config", str(path), "--log-level", "WARNING", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port or ports[0]}", timeout=30) as client:
            await until_healthy(client, process)
            yield process, client
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


async def until_healthy(client: httpx.AsyncClient, process: subprocess.Popen[bytes], seconds: float = 30) -> None:
    """Poll ``/health`` until it answers 200; fail at once if the process exits first."""
    with trio.fail_after(seconds):
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                assert process.poll() is None, f"tailguard exited with {process.returncode}"
            await trio.sleep(0.1)


async def exited(process: subprocess.Popen[bytes], timeout: float = 15) -> int:
    """The process's exit status, waited for (bounded)."""
    with trio.fail_after(timeout):
        while process.poll() is None:
            await trio.sleep(0.05)
    return process.returncode
