"""The ``tailguard`` command: check-config, and serve --simulate as a real process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from server.cli import main

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_check_config_prints_the_effective_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "config.toml")]) == 0
    out = capsys.readouterr().out
    for needle in ("pool interactive", "pool batch", "http://127.0.0.1:8001", "http://127.0.0.1:8002", "output_cap_tokens", "1024"):
        assert needle in out


def test_check_config_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "config.toml").read_text()
    broken = text.replace("max_queue = 256", "max_queue = -1").replace("[limits]", "[limits]\nbogus = 1", 1)
    path = tmp_path / "broken.toml"
    path.write_text(broken)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pools.interactive.max_queue" in err and "limits.bogus" in err


@asynccontextmanager
async def serve_process(tmp_path: Path) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient]]:
    """``tailguard serve --simulate`` on free ports, ready (healthy), killed if the test leaves it up."""
    ports = [free_port() for _ in range(4)]
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{ports[0]}").replace(":8001", f":{ports[1]}").replace(":8002", f":{ports[2]}")
    text = text.replace("127.0.0.1:50051", f"127.0.0.1:{ports[3]}")
    path = tmp_path / "config.toml"
    path.write_text(text)
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--simulate", "--config", str(path), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", timeout=30) as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            yield process, client
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


async def exited(process: subprocess.Popen[bytes], timeout: float = 15) -> int:
    with trio.fail_after(timeout):
        while process.poll() is None:
            await trio.sleep(0.05)
    return process.returncode


async def test_serve_simulate_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    async with serve_process(tmp_path) as (process, client):
        body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["x-tailguard-pool"] == "interactive"
        assert response.json()["usage"]["completion_tokens"] == 8
        process.send_signal(signal.SIGINT)
        assert await exited(process) == 0


async def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    async with serve_process(tmp_path) as (process, client):
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 120, "stream": True}
        streams: list[bytes] = []

        async def one_stream(first_bytes: trio.Event) -> None:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                chunks = []
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
                    first_bytes.set()
                streams.append(b"".join(chunks))

        async with trio.open_nursery() as nursery:
            started = [trio.Event() for _ in range(3)]
            for event in started:
                nursery.start_soon(one_stream, event)
            for event in started:
                await event.wait()
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                while (health := await client.get("/health")).status_code == 200:
                    await trio.sleep(0.01)
            assert health.status_code == 503 and health.json()["draining"] is True
            refused = await client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert refused.headers["retry-after"] == "1"
            assert len(streams) < 3, "the streams should still be running while the drain refuses new work"
        # Every in-flight stream ran to its end: 120 tokens and the [DONE] marker.
        assert len(streams) == 3
        for text in streams:
            assert text.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in text
        assert await exited(process) == 0
