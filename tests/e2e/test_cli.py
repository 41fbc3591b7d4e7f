"""The ``tailguard`` command: check-config, and serve --simulate as a real process."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tailguard.server.cli import main
from tests.helpers.process import ROOT, config_on_free_ports, exited, free_port, serve_process


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"tailguard {importlib.metadata.version('tailguard')}\n"


def test_init_is_listed_in_the_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "init" in capsys.readouterr().out


def test_check_config_prints_the_effective_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "config.toml")]) == 0
    out = capsys.readouterr().out
    for needle in ("pool interactive", "pool batch", "http://127.0.0.1:8001", "http://127.0.0.1:8002", "output_cap_tokens", "1024"):
        assert needle in out


def test_check_config_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "config.toml").read_text()
    broken = text.replace("max_queue = 1024", "max_queue = -1").replace("[limits]", "[limits]\nbogus = 1", 1)
    path = tmp_path / "broken.toml"
    path.write_text(broken)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pools.interactive.max_queue" in err and "limits.bogus" in err


def test_check_config_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """``tailguard check-config | head`` must not end in a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tailguard.server", "check-config", "--config", str(ROOT / "config.toml")],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


async def test_serve_simulate_answers_and_stops_on_sigint(tailguard_process: tuple[subprocess.Popen[bytes], httpx.AsyncClient]) -> None:
    process, client = tailguard_process
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["x-tailguard-pool"] == "interactive"
    assert response.json()["usage"]["completion_tokens"] == 8
    process.send_signal(signal.SIGINT)
    assert await exited(process) == 0


async def test_grpc_takes_calls_as_soon_as_http_answers_health(tmp_path: Path) -> None:
    """A readiness probe on /health must not send gRPC callers to a port that refuses them: the real-vLLM suite's
    gRPC test met "Connection refused" 1.2 s after /health answered (gRPC's server started after HTTP's)."""
    ports = [free_port() for _ in range(4)]
    path = config_on_free_ports(tmp_path, ports)
    process = subprocess.Popen(
        [sys.executable, "-m", "tailguard.server", "serve", "--simulate", "--config", str(path), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(60):
            while True:  # the HTTP port's first accepted connection: /health answers on it at once
                try:
                    with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
                        break
                except ConnectionRefusedError:
                    assert process.poll() is None, f"tailguard exited with {process.returncode}"
                    await trio.sleep(0.005)
        with socket.create_connection(("127.0.0.1", ports[3]), timeout=5):
            pass  # accepted: gRPC listens
    finally:
        process.kill()
        process.wait()


async def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tailguard_process: tuple[subprocess.Popen[bytes], httpx.AsyncClient]) -> None:
    process, client = tailguard_process
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


# -- a port in use, and the listen flags (issue 14, papercut 1) ------------------------------


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another program listens on (no SO_REUSEADDR/SO_REUSEPORT: nobody else may bind it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_in_use_is_one_line_naming_the_key_and_exit_2(tmp_path: Path) -> None:
    with held_port() as port:
        path = config_on_free_ports(tmp_path, [port, free_port(), free_port(), free_port()])
        done = subprocess.run(
            [sys.executable, "-m", "tailguard.server", "serve", "--simulate", "--config", str(path), "--log-level", "WARNING"],
            capture_output=True, text=True, timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr == f"tailguard: cannot listen on 127.0.0.1:{port} (server.http_listen): Address already in use\n"


@pytest.mark.parametrize("which", ["grpc", "simulated engine", "http", "--http-listen", "--grpc-listen"])
def test_every_address_in_use_names_where_it_comes_from(which: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with held_port() as held:
        ports = [free_port() for _ in range(4)]  # chosen while held is bound: none of them can be it
        flags: list[str] = []
        if which == "grpc":
            ports[3] = held
            named = "server.grpc_listen"
        elif which == "simulated engine":
            ports[2] = held
            named = f"--simulate endpoint http://127.0.0.1:{held}"
        elif which == "http":
            ports[0] = held
            named = "server.http_listen"
        else:
            flags = [which, f"127.0.0.1:{held}"]
            named = which
        path = config_on_free_ports(tmp_path, ports)
        status = main(["serve", "--simulate", "--config", str(path), "--log-level", "WARNING", *flags])
    assert status == 2
    assert capsys.readouterr().err == f"tailguard: cannot listen on 127.0.0.1:{held} ({named}): Address already in use\n"


async def test_http_listen_overrides_the_config(tmp_path: Path) -> None:
    port = free_port()
    async with serve_process(tmp_path, ["--http-listen", f"127.0.0.1:{port}"], http_port=port) as (process, client):
        response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert response.status_code == 200
        process.send_signal(signal.SIGINT)
        assert await exited(process) == 0


@pytest.mark.parametrize("value", ["8080", "localhost", "::1:8080", "127.0.0.1:70000"])
def test_listen_flags_are_checked_like_the_config_keys(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited_with:
        main(["serve", "--grpc-listen", value])
    assert exited_with.value.code == 2
    err = capsys.readouterr().err
    assert "--grpc-listen" in err and 'must be "host:port"' in err


# -- which config file (issue 14, papercut 5) -------------------------------------------------


def test_check_config_takes_config_as_serve_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.toml"
    path.write_text((ROOT / "config.toml").read_text().replace("max_queue = 1024", "max_queue = 77"))
    assert main(["check-config", "--config", str(path)]) == 0
    by_flag = capsys.readouterr().out
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out == by_flag
    assert by_flag.splitlines()[0] == f"config file: {path}" and "77" in by_flag
    with pytest.raises(SystemExit):
        main(["check-config", str(path), "--config", str(path)])


def test_a_config_toml_in_the_working_directory_wins_over_the_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check-config"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"config file: {ROOT / 'config.toml'}"
    (tmp_path / "config.toml").write_text((ROOT / "config.toml").read_text().replace("max_queue = 1024", "max_queue = 77"))
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"config file: {tmp_path / 'config.toml'}" and "77" in out


def test_the_readme_says_how_the_config_file_is_found() -> None:
    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme[readme.index("\n## Configuration") :].split("\n## ")[1].split())
    assert "--config" in section and "./config.toml" in section
    assert "check-config --config" in section
