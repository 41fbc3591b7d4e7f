"""The ``tailguard`` command: check-config, and serve --simulate as a real process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
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


async def test_serve_simulate_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{ports[0]}").replace(":8001", f":{ports[1]}").replace(":8002", f":{ports[2]}")
    path = tmp_path / "config.toml"
    path.write_text(text)
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--simulate", "--config", str(path), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}") as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200 and response.headers["x-tailguard-pool"] == "interactive"
            assert response.json()["usage"]["completion_tokens"] == 8
        process.send_signal(signal.SIGINT)
        with trio.fail_after(15):
            while process.poll() is None:
                await trio.sleep(0.05)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
