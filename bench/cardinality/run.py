"""``python -m bench cardinality``: /metrics and memory after reloads rotate many API keys.

Real time on 127.0.0.1: ``tailguard serve --simulate`` with ``--keys`` API
keys (each with a token budget) in a keys file; every key sends one
request, then a reload (SIGHUP) replaces every key by as many new ones, and
those send one each, ``--rotations`` times. After ``--idle`` s with nothing
sent, the size and line count of /metrics (and the time one scrape takes)
and the process's RSS are read. Each key's requests go ``--concurrency``
at a time; every step is bounded in count and time. Writes
``bench/results/cardinality/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from bench.harness.cli import driver_parser, run_and_report
from bench.harness.client import CHAT_PATH, HOST, KeepAliveClient, ProtocolError
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import RESULTS_ROOT, free_ports, read_status, start_tailguard, wait_ready
from bench.harness.toml import TomlTable, dumps

RESULTS = RESULTS_ROOT / "cardinality"
_KEYS_ENV = "TAILGUARD_BENCH_KEYS_FILE"
_STEP_TIMEOUT_S = 300.0  # one rotation's requests, or one reload, at most


@dataclass
class Result:
    keys: int
    rotations: int
    idle_s: float
    extra: list[str]
    failed_requests: int = 0
    metrics_bytes: int = 0
    metrics_lines: int = 0
    caller_lines: int = 0  # lines naming a caller label
    scrape_s: float = 0.0
    rss_mib: float = 0.0
    rss_mib_before_idle: float = 0.0
    wall_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)


def _keys_file(path: Path, generation: int, count: int) -> None:
    keys: list[TomlTable] = [{"name": f"k{generation}-{i}", "key": f"secret-{generation}-{i}", "tokens_per_minute": 100000} for i in range(count)]
    path.write_text(dumps({"keys": keys}))


def _config(http: int, grpc: int, e1: int, e2: int, extra: Sequence[str]) -> str:
    """Two pools of 64 seats, the keys from the file ``_KEYS_ENV`` names; ``extra`` lines are TOML read after ``[auth]``'s key."""
    sections = tomllib.loads("\n".join(["[auth]", f'keys_file_env = "{_KEYS_ENV}"', *extra]))
    return tailguard_config(http, grpc, PoolSpec("interactive", [(e1, 64)], 64, 4096), PoolSpec("batch", [(e2, 64)], 64, 4096), sections=sections)


def _request(port: int, key: str) -> bytes:
    body = b'{"model":"sim-llama-3.1-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _get(port: int, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
    """One GET on a fresh connection (httpx: the client's speed is not measured here), the whole body read."""
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        response = await client.get(f"http://{HOST}:{port}{path}", headers={**headers, "connection": "close"})
    return response.status_code, response.content


async def _send_all(port: int, generation: int, count: int, concurrency: int, result: Result) -> None:
    keys = iter(range(count))

    async def worker() -> None:
        client = KeepAliveClient(port)
        try:
            for i in keys:
                try:
                    reply = await client.exchange(_request(port, f"secret-{generation}-{i}"))
                    status = str(reply.status)
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    status = "error"
                result.statuses[status] = result.statuses.get(status, 0) + 1
                result.failed_requests += status != "200"
        finally:
            await client.aclose()

    with trio.fail_after(_STEP_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)


async def _reloads_ok(port: int, headers: Mapping[str, str]) -> float:
    _, page = await _get(port, "/metrics", headers)
    for line in page.decode().splitlines():
        if line.startswith('tailguard_config_reloads_total{result="ok"}'):
            return float(line.split()[-1])
    return 0.0


def _rss_mib(pid: int) -> float:
    return int(read_status(pid)["VmRSS"].split()[0]) / 1024


async def measure(options: argparse.Namespace) -> Result:
    result = Result(options.keys, options.rotations, options.idle, list(options.extra))
    http, grpc, e1, e2 = free_ports(4)
    workdir = Path(tempfile.mkdtemp(prefix="tg-cardinality-"))
    keys_path = workdir / "keys.toml"
    _keys_file(keys_path, 0, options.keys)
    config = _config(http, grpc, e1, e2, options.extra)
    config_path = workdir / "config.toml"
    config_path.write_text(config)
    os.environ[_KEYS_ENV] = str(keys_path)
    headers = dict((name.strip(), value.strip()) for name, _, value in (h.partition(":") for h in options.scrape_header))
    async with trio.open_nursery() as nursery:
        process = await start_tailguard(nursery, config_path, extra_args=["--simulate", "--no-grpc"])
        await wait_ready(http, process, "tailguard")
        await _send_all(http, 0, options.keys, options.concurrency, result)
        for generation in range(1, options.rotations + 1):
            before = await _reloads_ok(http, headers)
            _keys_file(keys_path, generation, options.keys)
            process.send_signal(signal.SIGHUP)
            with trio.fail_after(_STEP_TIMEOUT_S):
                while await _reloads_ok(http, headers) <= before:
                    await trio.sleep(0.2)
            await _send_all(http, generation, options.keys, options.concurrency, result)
        result.rss_mib_before_idle = _rss_mib(process.pid)
        await trio.sleep(options.idle)
        started = time.perf_counter()
        status, page = await _get(http, "/metrics", headers)
        result.scrape_s = time.perf_counter() - started
        assert status == 200, status
        result.metrics_bytes = len(page)
        lines = page.decode().splitlines()
        result.metrics_lines = len(lines)
        result.caller_lines = sum('caller="' in line for line in lines)
        result.rss_mib = _rss_mib(process.pid)
        nursery.cancel_scope.cancel()
    return result


def render(result: Result) -> str:
    return "\n".join(
        [
            f"# Per-caller cardinality: {result.keys} keys, {result.rotations} rotations, {result.idle_s:g} s idle",
            "",
            f"- requests not 200: {result.failed_requests} ({result.statuses})",
            f"- /metrics: {result.metrics_bytes / 1e6:.2f} MB, {result.metrics_lines} lines ({result.caller_lines} with a caller), "
            f"scraped in {result.scrape_s:.3f} s",
            f"- RSS: {result.rss_mib_before_idle:.1f} MiB after the last rotation, {result.rss_mib:.1f} MiB after the idle time",
            f"- extra config: {result.extra or 'none'}; wall {result.wall_s:.0f} s",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add = parser.add_argument
    add("--keys", type=int, default=5000, help="API keys in each generation (default %(default)s)")
    add("--rotations", type=int, default=2, help="reloads that replace every key (default %(default)s)")
    add("--idle", type=float, default=70.0, help="s with nothing sent before the figures are read (default %(default)s)")
    add("--concurrency", type=int, default=32, help="requests in flight at once (default %(default)s)")
    add("--extra", action="append", default=[], help="a config line put after [auth] (e.g. a [metrics] table's line); repeatable")
    add("--scrape-header", action="append", default=[], help="a header line sent with each GET /metrics, e.g. 'Authorization: Bearer T'")
    add("--out", type=Path, default=RESULTS, help="results folder (default %(default)s)")
    add("--name", default="cardinality", help="results file stem (default %(default)s)")
    return parser


def main(argv: Sequence[str]) -> int:
    options = build_parser().parse_args(argv)
    return run_and_report(measure, options, said="tailguard stopped", render=render, out=options.out, stem=options.name)
