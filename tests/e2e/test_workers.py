"""``tailguard serve --workers 2`` as real processes: shared ports, one set of caps, restarts, signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.helpers.process import ROOT, exited, free_port
from tests.helpers.redis_server import REDIS

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)")


def free_run(length: int) -> int:
    """A port P with P .. P+length-1 all free now."""
    for _ in range(100):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + length):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


async def wait_healthy(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    with trio.fail_after(40):
        while True:
            try:
                response = await client.get(url)
                if response.status_code == 200:
                    return dict(response.json())
            except httpx.TransportError:
                pass
            await trio.sleep(0.1)


def requests_served(page: str) -> float:
    return sum(float(v) for v in re.findall(r'^tailguard_requests_total\{[^}]*\} ([0-9.e+]+)$', page, re.M))


async def test_two_workers_share_the_port_and_the_caps_restart_and_stop_on_signals(tmp_path: Path) -> None:
    http = free_run(3)  # the shared port and each worker's own
    engines = [free_port(), free_port()]
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{http}").replace(":8001", f":{engines[0]}").replace(":8002", f":{engines[1]}")
    text = text.replace("drain_timeout = 30.0", "drain_timeout = 5.0").replace("reload_poll_interval = 1.0", "reload_poll_interval = 0")
    assert "reload_poll_interval = 0\n" in text  # only SIGHUP reloads here
    # Left to the engines: worker 1 asks them, and must wait until worker 0 has started them.
    text, removed = re.subn(r"(?m)^max_model_len = .*\n", "", text)
    assert removed == 2
    path = tmp_path / "config.toml"
    path.write_text(text)
    process = subprocess.Popen(
        [sys.executable, "-m", "tailguard.server", "serve", "--workers", "2", "--simulate", "--no-grpc", "--config", str(path), "--log-format", "text"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            own = [f"http://127.0.0.1:{http + 1 + i}" for i in range(2)]
            replicas = {str((await wait_healthy(client, url + "/health"))["cluster"]["replica"]) for url in own}  # type: ignore[index]
            assert len(replicas) == 2  # two processes, each its own replica of the shared ledger
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for _ in range(40):  # new connections: the kernel spreads them over both listeners
                async with httpx.AsyncClient(timeout=30) as fresh:
                    assert (await fresh.post(f"http://127.0.0.1:{http}/v1/chat/completions", json=body)).status_code == 200
            pages = [(await client.get(url + "/metrics")).text for url in own]
            served = [requests_served(page) for page in pages]
            assert sum(served) == 40 and min(served) > 0, served  # both workers served some
            assert all(re.search(r"^process_cpu_seconds_total \S+$", page, re.M) for page in pages)  # each its own process's

            path.write_text(text.replace("max_queue = 1024", "max_queue = 200"))
            process.send_signal(signal.SIGHUP)  # each worker reloads the file
            with trio.fail_after(10):
                while True:
                    pages = [(await client.get(url + "/metrics")).text for url in own]
                    if all(RELOADED.search(page) for page in pages):
                        break
                    await trio.sleep(0.1)
        # kill -9 a worker: the supervisor starts it again
        (pid,) = worker_1_pids(process)
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(20):  # the supervisor notices and starts another process in its place
            while not worker_1_pids(process) - {pid}:
                await trio.sleep(0.1)
        assert b"worker 1 died" in _drain(process)
        async with httpx.AsyncClient(timeout=30) as client:
            await wait_healthy(client, own[1] + "/health")  # and the new one serves on the killed one's port
        process.send_signal(signal.SIGTERM)
        assert await exited(process, timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


def worker_1_pids(process: subprocess.Popen[bytes]) -> set[int]:
    """Every process the supervisor has started as worker 1 so far, from its log."""
    return {int(pid) for pid in re.findall(rb"worker 1 started \(pid (\d+)\)", _drain(process))}


_seen: dict[int, bytes] = {}
RELOADED = re.compile(r'^tailguard_config_reloads_total\{result="ok"\} 1\.0$', re.M)


def _drain(process: subprocess.Popen[bytes]) -> bytes:
    """What the process has printed so far (non-blocking read of its pipe)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    chunks = [_seen.get(process.pid, b"")]
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    _seen[process.pid] = b"".join(chunks)
    return _seen[process.pid]


async def test_a_worker_that_cannot_start_stops_the_supervisor_with_status_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = (ROOT / "config.toml").read_text().replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        text = text.replace(":8001", f":{free_port()}").replace(":8002", f":{free_port()}")
        path = tmp_path / "config.toml"
        path.write_text(text)
        output = tmp_path / "out.log"
        # The port is taken without SO_REUSEPORT: no worker can share it.
        with output.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "tailguard.server", "serve", "--workers", "2", "--no-grpc", "--config", str(path)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            assert await exited(process, timeout=40) == 2  # not restarted for ever
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        assert b"could not start" in output.read_bytes()
