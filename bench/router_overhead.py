"""``python -m bench.router_overhead``: what tailguard adds to a request, beside calling the engine directly.

One run, one machine, side by side: the simulator serves two engines in the
``instant`` profile (no GPU cost, so every millisecond measured is HTTP, JSON
and scheduling), and tailguard runs in front of them from a temporary
config. A closed loop of short, non-streaming chat completions (interactive
class) goes first straight to engine 1, then through tailguard, at each
concurrency; the difference is the router's overhead. The router's CPU time
per request comes from ``/proc/PID/stat``; the simulator's and this client's
CPU are reported too, so a reader can tell which process was the limit.

The load client is lean on purpose (raw Trio sockets, keep-alive HTTP/1.1,
hand-parsed responses): on a two-core machine an httpx client would compete
with the router for CPU and inflate what is attributed to it. The helpers
here (client, processes, config) are shared with ``bench.quick_mixed``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import trio

from tailguard.sim.virtual.mix import percentile
from bench.sim_cpu import PROJECT_ROOT, free_ports, interrupted, process_cpu_seconds, stop

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "router_overhead.json"
HOST = "127.0.0.1"
CHAT_PATH = "/v1/chat/completions"

_READ_SIZE = 64 * 1024
_READY_TIMEOUT_S = 30.0
_ERROR_BACKOFF_S = 0.05
_LOG_TAIL_BYTES = 4000
_DONE = b"data: [DONE]"


# -- a lean keep-alive HTTP/1.1 client ---------------------------------------


class ProtocolError(Exception):
    """The server closed the connection early or sent something unparsable."""


@dataclass
class Reply:
    """One response, as much of it as a benchmark needs."""

    status: int
    body_bytes: int
    marker_at: float | None  # perf_counter() when the marker (e.g. a token event) first arrived
    done_seen: bool  # the body held "data: [DONE]" (streams)
    keep_alive: bool


class KeepAliveClient:
    """One connection to one port, opened lazily, reopened after a failure.

    Requests go one at a time (no pipelining). Parsing is hand-written and
    minimal (status line, Content-Length, chunked framing, Connection: close)
    so the client costs a few tens of microseconds a response.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._stream: trio.SocketStream | None = None
        self._buffer = b""

    async def exchange(self, request: bytes, marker: bytes | None = None) -> Reply:
        """Send ``request`` (complete bytes), read the whole response.

        Raises OSError, trio.BrokenResourceError or ProtocolError on failure,
        after closing the connection (the next call opens a new one).
        """
        try:
            if self._stream is None:
                self._stream = await trio.open_tcp_stream(HOST, self.port)
                self._buffer = b""
            await self._stream.send_all(request)
            reply = await self._read_reply(marker)
        except BaseException:
            await self.aclose()
            raise
        if not reply.keep_alive:
            await self.aclose()
        return reply

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await trio.aclose_forcefully(stream)

    async def _fill(self) -> None:
        assert self._stream is not None
        data = await self._stream.receive_some(_READ_SIZE)
        if not data:
            raise ProtocolError("the server closed the connection mid-response")
        self._buffer += data

    async def _read_reply(self, marker: bytes | None) -> Reply:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ProtocolError(f"bad status line {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = headers.get(b"connection") != b"close"
        scan = _Scan(marker)
        if headers.get(b"transfer-encoding") == b"chunked":
            await self._read_chunked(scan)
        elif b"content-length" in headers:
            await self._read_exactly(int(headers[b"content-length"]), scan)
        else:
            raise ProtocolError("a response without Content-Length or chunked framing")
        return Reply(status, scan.size, scan.marker_at, scan.done_seen, keep_alive)

    async def _read_exactly(self, size: int, scan: _Scan | None) -> None:
        while len(self._buffer) < size:
            await self._fill()
        if scan is not None:
            scan.feed(self._buffer[:size])
        self._buffer = self._buffer[size:]

    async def _read_chunked(self, scan: _Scan) -> None:
        while True:
            while (end := self._buffer.find(b"\r\n")) < 0:
                await self._fill()
            try:
                size = int(self._buffer[:end].split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {self._buffer[:end][:40]!r}") from None
            self._buffer = self._buffer[end + 2 :]
            if size == 0:
                while not self._buffer.startswith(b"\r\n") and (trailers := self._buffer.find(b"\r\n\r\n")) < 0:
                    await self._fill()
                cut = 2 if self._buffer.startswith(b"\r\n") else trailers + 4
                self._buffer = self._buffer[cut:]
                return
            await self._read_exactly(size, scan)
            await self._read_exactly(2, None)  # the chunk's CRLF


class _Scan:
    """Counts body bytes and notes when ``marker`` and ``[DONE]`` first appear.

    A short tail of earlier bytes is kept so a marker split across reads or
    chunks is still found.
    """

    def __init__(self, marker: bytes | None) -> None:
        self.marker = marker
        self.size = 0
        self.marker_at: float | None = None
        self.done_seen = False
        self._tail = b""

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        window = self._tail + data
        if self.marker is not None and self.marker_at is None and self.marker in window:
            self.marker_at = time.perf_counter()
        if not self.done_seen and _DONE in window:
            self.done_seen = True
        self._tail = window[-32:]


def http_request(port: int, path: str, payload: object) -> bytes:
    """A keep-alive POST with a JSON body, as bytes (built once, sent many times)."""
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# -- processes ------------------------------------------------------------------


async def start_simulator(
    nursery: trio.Nursery, engines: Sequence[tuple[int, str]], time_scale: float = 1.0, log: IO[bytes] | None = None
) -> trio.Process:
    """``python -m tailguard.sim`` with (port, profile) engines; cancelling ``nursery`` terminates it."""
    spec = ",".join(f"{port}:{profile}" for port, profile in engines)
    command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--time-scale", f"{time_scale:g}"]
    return await start_process(nursery, command, log)


async def start_tailguard(
    nursery: trio.Nursery, config: Path, log: IO[bytes] | None = None, extra_args: Sequence[str] = ()
) -> trio.Process:
    """``python -m tailguard.server serve --config CONFIG``; cancelling ``nursery`` terminates it."""
    command = [sys.executable, "-m", "tailguard.server", "serve", "--config", str(config), "--log-level", "WARNING", *extra_args]
    return await start_process(nursery, command, log)


async def start_process(nursery: trio.Nursery, command: list[str], log: IO[bytes] | None) -> trio.Process:
    # trio.run_process terminates the child (SIGTERM, then SIGKILL) when its
    # scope is cancelled: by an error, by Ctrl-C, or at the end of the run.
    run = partial(
        trio.run_process, command, cwd=str(PROJECT_ROOT), stdout=subprocess.DEVNULL, stderr=log, check=False
    )
    process: trio.Process = await nursery.start(run)
    return process


async def wait_ready(port: int, process: trio.Process, name: str) -> None:
    """Poll GET /health until it answers 200 (tailguard: every pool healthy)."""
    client = KeepAliveClient(port)
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    try:
        with trio.fail_after(_READY_TIMEOUT_S):
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} before it was ready")
                try:
                    if (await client.exchange(request)).status == 200:
                        return
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    pass
                await trio.sleep(0.05)
    except trio.TooSlowError:
        raise RuntimeError(f"{name} on port {port} was not ready within {_READY_TIMEOUT_S:g} s") from None
    finally:
        await client.aclose()


def log_tail(path: Path) -> str:
    """The end of a child's log, to show when it failed."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")


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


# -- statistics -------------------------------------------------------------------


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds of the processes under test and of this client, at one instant."""

    wall: float
    processes: dict[str, float]
    client: float

    @staticmethod
    def read(pids: dict[str, int]) -> CpuClock:
        return CpuClock(time.perf_counter(), {name: _cpu_seconds(name, pid) for name, pid in pids.items()}, time.process_time())

    def seconds_since(self, before: CpuClock) -> dict[str, float]:
        """CPU seconds of each process (and "client", this one) between ``before`` and now."""
        seconds = {name: cpu - before.processes[name] for name, cpu in self.processes.items()}
        seconds["client"] = self.client - before.client
        return seconds

    def cores_since(self, before: CpuClock) -> dict[str, float]:
        """Cores used by each process (and "client") between ``before`` and now."""
        wall = self.wall - before.wall
        return {name: seconds / wall for name, seconds in self.seconds_since(before).items()}


def _cpu_seconds(name: str, pid: int) -> float:
    try:
        return sum(process_cpu_seconds(pid))
    except FileNotFoundError:
        raise RuntimeError(f"{name} (pid {pid}) exited during the run") from None


# -- the closed loop -----------------------------------------------------------------


@dataclass
class Budget:
    """How many requests a phase may still start, and until when (perf_counter)."""

    remaining: int
    deadline: float

    def take(self) -> bool:
        if self.remaining <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.remaining -= 1
        return True


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds
    errors: int = 0


async def closed_loop_worker(client: KeepAliveClient, request: bytes, budget: Budget, tally: Tally) -> None:
    """Send requests back to back on one connection while the budget lasts."""
    while budget.take():
        start = time.perf_counter()
        try:
            reply = await client.exchange(request)
        except (OSError, trio.BrokenResourceError, ProtocolError):
            tally.errors += 1
            await trio.sleep(_ERROR_BACKOFF_S)
            continue
        if reply.status == 200:
            tally.latencies.append(time.perf_counter() - start)
        else:
            tally.errors += 1


async def closed_loop(clients: Sequence[KeepAliveClient], request: bytes, count: int, seconds: float) -> tuple[Tally, float]:
    """Run ``count`` requests (or ``seconds``, whichever ends first) over ``clients``; (tally, wall s)."""
    tally = Tally()
    start = time.perf_counter()
    budget = Budget(count, start + seconds)
    with trio.move_on_after(seconds + 10):  # a hung response must not hang the run
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(closed_loop_worker, client, request, budget, tally)
    return tally, time.perf_counter() - start


# -- the run -------------------------------------------------------------------


@dataclass
class RunResult:
    target: str  # "direct" or "tailguard"
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    req_per_s: float
    cores: dict[str, float]  # CPU cores used during the run: simulator, tailguard, client
    router_cpu_ms_per_request: float | None

    @classmethod
    def from_tally(
        cls,
        target: str,
        concurrency: int,
        tally: Tally,
        wall: float,
        before: CpuClock,
        after: CpuClock,
        *,
        through_router: bool,
        router: str = "tailguard",
    ) -> RunResult:
        """Percentiles and CPU of one measured loop (the CPU of ``router``, a key of the pids, only when it was in the path)."""
        latencies = sorted(tally.latencies)
        n = len(latencies)
        return cls(
            target=target,
            concurrency=concurrency,
            requests=n,
            errors=tally.errors,
            wall_s=wall,
            p50_ms=percentile(latencies, 50) * 1000,
            p99_ms=percentile(latencies, 99) * 1000,
            mean_ms=sum(latencies) / n * 1000 if n else math.nan,
            max_ms=latencies[-1] * 1000 if n else math.nan,
            req_per_s=n / wall,
            cores=after.cores_since(before),
            router_cpu_ms_per_request=after.seconds_since(before)[router] / n * 1000 if through_router and n else None,
        )


@dataclass
class Overhead:
    concurrency: int
    added_p50_ms: float
    added_p99_ms: float
    req_per_s_direct: float
    req_per_s_tailguard: float


@dataclass
class Result:
    message: str
    max_tokens: int
    engine_profile: str
    serve_args: list[str]
    warmup_requests: int
    seconds_bound: float
    cpu_count: int
    runs: list[RunResult]
    overhead: list[Overhead]


@dataclass(frozen=True)
class Plan:
    concurrencies: Sequence[int]
    requests: Callable[[int], int]  # requests for one run at this concurrency
    seconds: float
    warmup: int
    serve_args: Sequence[str] = ()


MESSAGE = "What is the capital of France?"
MAX_TOKENS = 16


async def measure(plan: Plan) -> Result:
    """Start the simulator and tailguard, run every (concurrency, target), tear it all down."""
    sim_port, batch_port, tg_port, grpc_port = free_ports(4)
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}
    targets = {"direct": sim_port, "tailguard": tg_port}
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="tailguard-bench-") as tmp:
        config = Path(tmp) / "config.toml"
        pool = partial(PoolSpec, max_concurrency=1024, max_queue=4096)
        config.write_text(
            tailguard_config(tg_port, grpc_port, pool("interactive", [(sim_port, 1024)]), pool("batch", [(batch_port, 1024)]))
        )
        sim_log, tg_log = Path(tmp) / "sim.log", Path(tmp) / "tailguard.log"
        with sim_log.open("wb") as sim_out, tg_log.open("wb") as tg_out:
            try:
                async with trio.open_nursery() as nursery:
                    sim = await start_simulator(nursery, [(sim_port, "instant"), (batch_port, "instant")], log=sim_out)
                    await wait_ready(sim_port, sim, "the simulator")
                    await wait_ready(batch_port, sim, "the simulator")
                    tg = await start_tailguard(nursery, config, log=tg_out, extra_args=plan.serve_args)
                    await wait_ready(tg_port, tg, "tailguard")
                    pids = {"simulator": sim.pid, "tailguard": tg.pid}
                    for concurrency in plan.concurrencies:
                        for target, port in targets.items():
                            request = http_request(port, CHAT_PATH, payload)
                            runs.append(await measure_closed_loop(target, port, request, concurrency, plan, pids))
                            print(_progress(runs[-1]), file=sys.stderr, flush=True)
                    for process, name in ((tg, "tailguard"), (sim, "the simulator")):
                        if process.returncode is not None:
                            raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    await stop(tg)  # tailguard first: it must not see its backends vanish
                    nursery.cancel_scope.cancel()
            except Exception:
                print(f"--- simulator log ---\n{log_tail(sim_log)}\n--- tailguard log ---\n{log_tail(tg_log)}", file=sys.stderr)
                raise
    return Result(
        message=MESSAGE,
        max_tokens=MAX_TOKENS,
        engine_profile="instant",
        serve_args=list(plan.serve_args),
        warmup_requests=plan.warmup,
        seconds_bound=plan.seconds,
        cpu_count=_cpu_count(),
        runs=runs,
        overhead=_overheads(runs),
    )


async def measure_closed_loop(
    target: str, port: int, request: bytes, concurrency: int, plan: Plan, pids: dict[str, int], router: str | None = None
) -> RunResult:
    """Warm the connections up, then measure one closed loop on them.

    ``router`` names the pid whose CPU is the router's (default: tailguard's,
    when ``target`` is "tailguard"); None and another target: no router.
    """
    clients = [KeepAliveClient(port) for _ in range(concurrency)]
    try:
        await closed_loop(clients, request, max(plan.warmup, concurrency), plan.seconds)
        before = CpuClock.read(pids)
        tally, wall = await closed_loop(clients, request, plan.requests(concurrency), plan.seconds)
        after = CpuClock.read(pids)
    finally:
        for client in clients:
            await client.aclose()
    if router is None and target == "tailguard":
        router = "tailguard"
    return RunResult.from_tally(target, concurrency, tally, wall, before, after, through_router=router is not None, router=router or "tailguard")


def _overheads(runs: Sequence[RunResult]) -> list[Overhead]:
    by_key = {(r.target, r.concurrency): r for r in runs}
    overheads = []
    for concurrency in sorted({r.concurrency for r in runs}):
        direct, routed = by_key[("direct", concurrency)], by_key[("tailguard", concurrency)]
        overheads.append(
            Overhead(
                concurrency=concurrency,
                added_p50_ms=routed.p50_ms - direct.p50_ms,
                added_p99_ms=routed.p99_ms - direct.p99_ms,
                req_per_s_direct=direct.req_per_s,
                req_per_s_tailguard=routed.req_per_s,
            )
        )
    return overheads


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def _progress(run: RunResult) -> str:
    return f"  {run.target:>9} c={run.concurrency:<3} n={run.requests} P50 {run.p50_ms:.2f} ms P99 {run.p99_ms:.2f} ms {run.req_per_s:,.0f} req/s"


# -- reporting -------------------------------------------------------------------


def render_table(result: Result) -> str:
    lines = [
        "| target | concurrency | requests | errors | P50 ms | P99 ms | req/s | cores: sim / tailguard / client | router CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.runs:
        cores = f"{r.cores['simulator']:.2f} / {r.cores['tailguard']:.2f} / {r.cores['client']:.2f}"
        cpu = f"{r.router_cpu_ms_per_request:.3f}" if r.router_cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {r.target} | {r.concurrency} | {r.requests:,} | {r.errors} | {r.p50_ms:.3f} | {r.p99_ms:.3f} "
            f"| {r.req_per_s:,.0f} | {cores} | {cpu} |"
        )
    lines += [
        "",
        "| concurrency | added P50 ms | added P99 ms | req/s direct | req/s tailguard |",
        "|---|---|---|---|---|",
    ]
    for o in result.overhead:
        lines.append(
            f"| {o.concurrency} | {o.added_p50_ms:+.3f} | {o.added_p99_ms:+.3f} "
            f"| {o.req_per_s_direct:,.0f} | {o.req_per_s_tailguard:,.0f} |"
        )
    return "\n".join(lines)


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def add_serve_arg(parser: argparse.ArgumentParser) -> None:
    """``--serve-arg``: what every benchmark that starts tailguard passes on to ``tailguard serve``."""
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `tailguard serve`, repeatable; write it as --serve-arg=--no-grpc",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests",
        type=int,
        default=10_000,
        help="requests per measured run at the highest concurrency; concurrency 1 runs a fifth of it (default %(default)s)",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="time bound of each measured run (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured requests before each run (default %(default)s)")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated concurrencies (default %(default)s)")
    add_serve_arg(parser)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    if args.requests < 1 or args.seconds <= 0 or args.warmup < 0 or not concurrencies or min(concurrencies) < 1:
        parser.error("--requests and --concurrency must be >= 1, --seconds > 0, --warmup >= 0")
    top = max(concurrencies)
    plan = Plan(
        concurrencies=concurrencies,
        requests=lambda c: args.requests if c == top else max(1, args.requests // 5),
        seconds=args.seconds,
        warmup=args.warmup,
        serve_args=args.serve_arg,
    )
    started = time.perf_counter()
    try:
        result = trio.run(measure, plan)
    except BaseException as error:
        if not interrupted(error):
            raise
        print("interrupted; the simulator and tailguard were stopped", file=sys.stderr)
        return 130
    print(render_table(result))
    flags = " ".join(plan.serve_args) or "(default flags)"
    print(
        f"\n'{MESSAGE}', max_tokens {MAX_TOKENS}, non-streaming chat (interactive class); engines in the "
        f"'instant' profile; tailguard serve {flags}; closed loop on keep-alive connections, {plan.warmup} "
        f"warm-up requests per run; {result.cpu_count} CPUs shared by the simulator, tailguard and this client. "
        f"Wall time {time.perf_counter() - started:.0f} s."
    )
    write_json(args.json, asdict(result))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
