"""``python -m bench workers``: ``tailguard serve --workers 2`` beside ``--workers 1`` and vllm-router, one instant engine, one run.

One simulated engine in the ``instant`` profile (1,024 seats: at
concurrency 64 or 128 it never queues, so every microsecond is the
router's), and in front of it, one set-up at a time (each started, measured
and stopped before the next, so an idle one takes no core from the
measured one):

- the engine called directly (the ceiling of this client and machine);
- vllm-router (PyPI ``vllm-router``, ``--policy round_robin``, its defaults
  otherwise);
- ``tailguard serve --workers 1``: the plain single process, no
  ``[cluster]``, no Redis;
- ``tailguard serve --workers 2``: a supervisor, two workers on the same
  ports (``SO_REUSEPORT``) and the local ``redis-server`` the supervisor
  starts for the shared caps (no ``[cluster]`` in the file).

tailguard runs with its default flags (gRPC on, unused by this load). Each
set-up gets a closed loop of short non-streaming chats at each concurrency;
CPU per request sums every process of the set-up (the root and its
descendants, found through ``/proc/PID/task/*/children``), read from
``/proc/PID/stat``. The machine's busy cores and the load average are
recorded beside each run: the load generator, the engine and the router
share the same cores, and so may other work on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness import procs
from bench.harness.cli import add_out_arg, add_seconds_arg, add_warmup_arg, driver_parser, run_and_report
from bench.harness.client import HOST, Source
from bench.harness.clocks import MachineClock, cpu_count
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, Plan, RunResult, measure_closed_loop
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.peer import find_peer, peer_command, peer_version
from bench.harness.report import code_version, git_commit
from bench.harness.unique import unique_chat

RESULTS_DIR = procs.RESULTS_ROOT / "cluster"
POOL_CAP = 1024  # the instant profile's max_num_seqs: no cap binds at 64 or 128
DIRECT, PEER, ONE, TWO = "direct", "vllm-router", "tailguard --workers 1", "tailguard --workers 2"
SETUPS = (DIRECT, PEER, ONE, TWO)
_PORT_TRIES = 50


@dataclass(frozen=True)
class Options:
    concurrencies: Sequence[int]
    seconds: float  # each measured loop's time bound
    requests: int  # each measured loop's count bound
    warmup: int  # unmeasured requests before each loop
    rounds: int  # every set-up, every concurrency, this many times (the order reversed every other round)
    peer: Path | None
    command: str


@dataclass
class Row:
    """One measured closed loop of one set-up."""

    round: int
    setup: str
    run: RunResult  # its cores: "simulator", "client" and every process of the set-up
    setup_processes: list[str]  # the keys of run.cores that are the set-up's
    setup_cores: float
    cpu_us_per_request: float | None  # every process of the set-up; None for the engine called directly
    machine_busy_cores: float  # every process on the machine, warm-up included
    others_cores: float  # machine busy - simulator - set-up - client: work that is not ours
    load_average_start: list[float]
    load_average_end: list[float]


@dataclass
class Ratio:
    round: int
    concurrency: int
    cpu_per_request_two_over_one: float | None  # --workers 2 / --workers 1
    req_per_s_two_over_one: float | None
    req_per_s_one_over_peer: float | None  # tailguard --workers N / vllm-router
    req_per_s_two_over_peer: float | None


@dataclass
class Result:
    command: str
    code: str  # the commit measured (code_version)
    commit: str  # short HEAD
    cpu_count: int
    peer: str | None
    engine: str
    message: str
    max_tokens: int
    parameters: dict[str, object]
    load_average_start: list[float]
    load_average_end: list[float] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    wall_s: float = 0.0


# -- process trees ---------------------------------------------------------------------


ProcId = tuple[int, int]  # (pid, start time in clock ticks): a pid the kernel has not reused


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22 of proc(5)


def process_tree(root: int) -> list[ProcId]:
    """``root`` and every descendant, from ``/proc/PID/task/*/children`` (gone ones left out)."""
    found: list[ProcId] = []
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            found.append((pid, _start_ticks(pid)))
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    pending += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def kill_leftovers(tree: Sequence[ProcId]) -> None:
    """SIGKILL every process of ``tree`` still running as the same process (its start time unchanged)."""
    for pid, ticks in tree:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if _start_ticks(pid) == ticks:
                os.kill(pid, signal.SIGKILL)


# -- set-ups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    port: int  # where the load goes
    pids: dict[str, int]  # the set-up's processes by name ("comm pid")


def _ports_with_neighbours(count: int) -> tuple[int, int]:
    """(P, G): P..P+count free together (a worker serves P+1+i), and G free too."""
    for _ in range(_PORT_TRIES):
        base, grpc = procs.free_ports(2)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count + 1):
                    stack.enter_context(socket.socket()).bind((HOST, port))
                if grpc not in range(base, base + count + 1):
                    return base, grpc
        except OSError:
            continue
    raise RuntimeError(f"no {count + 1} consecutive free ports on {HOST} in {_PORT_TRIES} tries")


@contextlib.asynccontextmanager
async def running(setup: str, engine_port: int, batch_port: int, peer: Path | None, tmp: Path, log: IO[bytes]) -> AsyncIterator[Running]:
    """Start ``setup`` in front of the engine, wait until it is ready, yield it; stop all of it on every way out."""
    if setup == DIRECT:
        yield Running(engine_port, {})
        return
    tree: list[ProcId] = []
    async with trio.open_nursery() as nursery:
        process: trio.Process | None = None
        try:
            if setup == PEER:
                assert peer is not None
                port, metrics_port = procs.free_ports(2)
                process = await procs.start_process(nursery, peer_command(peer, port, metrics_port, engine_port), log)
                await procs.wait_ready(port, process, setup)
            else:
                workers = 2 if setup == TWO else 1
                port, grpc_port = _ports_with_neighbours(workers)
                config = tmp / f"workers{workers}.toml"
                pool = partial(PoolSpec, max_concurrency=POOL_CAP, max_queue=4 * POOL_CAP)
                config.write_text(tailguard_config(port, grpc_port, pool("interactive", [(engine_port, POOL_CAP)]), pool("batch", [(batch_port, POOL_CAP)])))
                process = await procs.start_tailguard(nursery, config, log=log, extra_args=["--workers", str(workers)])
                for ready in [port] + [port + 1 + i for i in range(workers) if workers > 1]:  # and each worker's own port
                    await procs.wait_ready(ready, process, f"{setup} on port {ready}")
            tree = process_tree(process.pid)
            yield Running(port, {f"{_comm(pid)} {pid}": pid for pid, _ in tree})
            await procs.stop(process)
        finally:
            with trio.CancelScope(shield=True):
                if process is not None and process.returncode is None:
                    tree = tree or process_tree(process.pid)
                    await procs.stop(process)
                kill_leftovers(tree)  # a supervisor killed before its workers had drained leaves them behind
            nursery.cancel_scope.cancel()


# -- the run ---------------------------------------------------------------------------


async def measure(options: Options, result: Result) -> Result:
    """Start the engine; each round, each set-up in turn: start, measure every concurrency, stop."""
    engine_port, batch_port = procs.free_ports(2)
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}
    plan = Plan(concurrencies=options.concurrencies, requests=lambda _: options.requests, seconds=options.seconds, warmup=options.warmup)
    setups = [s for s in SETUPS if s != PEER or options.peer is not None]
    with tempfile.TemporaryDirectory(prefix="tailguard-workers-") as tmp_dir:
        tmp = Path(tmp_dir)
        sim_log, setup_log = tmp / "simulator.log", tmp / "setups.log"
        with sim_log.open("wb") as sim_out, setup_log.open("wb") as setup_out:
            try:
                async with trio.open_nursery() as nursery:
                    sim = await procs.start_simulator(nursery, [(engine_port, "instant"), (batch_port, "instant")], log=sim_out)
                    await procs.wait_ready(engine_port, sim, "the simulator")
                    await procs.wait_ready(batch_port, sim, "the simulator")
                    for round_ in range(1, options.rounds + 1):
                        for setup in setups if round_ % 2 else setups[::-1]:
                            async with running(setup, engine_port, batch_port, options.peer, tmp, setup_out) as up:
                                request = unique_chat(up.port, payload, "workers", round_, setup)
                                for concurrency in options.concurrencies:
                                    row = await _one_loop(round_, setup, up, request, concurrency, plan, sim.pid)
                                    result.rows.append(row)
                                    print(_progress(row), file=sys.stderr, flush=True)
                    if sim.returncode is not None:
                        raise RuntimeError(f"the simulator exited with {sim.returncode} during the run")
                    nursery.cancel_scope.cancel()
            except Exception:
                print(f"--- simulator log ---\n{procs.log_tail(sim_log)}\n--- set-ups' log ---\n{procs.log_tail(setup_log)}", file=sys.stderr)
                raise
    result.ratios = _ratios(result.rows)
    result.load_average_end = _load_average()  # every process of the run has stopped
    return result


async def _one_loop(round_: int, setup: str, up: Running, request: Source, concurrency: int, plan: Plan, sim_pid: int) -> Row:
    load_start = _load_average()
    machine = MachineClock.read()
    run = await measure_closed_loop(setup, up.port, request, concurrency, plan, {"simulator": sim_pid, **up.pids})
    busy = MachineClock.read().cores_since(machine)
    setup_cores = sum(run.cores[name] for name in up.pids)
    return Row(
        round=round_,
        setup=setup,
        run=run,
        setup_processes=list(up.pids),
        setup_cores=setup_cores,
        cpu_us_per_request=setup_cores / run.req_per_s * 1e6 if up.pids and run.req_per_s > 0 else None,
        machine_busy_cores=busy,
        others_cores=busy - setup_cores - run.cores["simulator"] - run.cores["client"],
        load_average_start=load_start,
        load_average_end=_load_average(),
    )


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _ratios(rows: Sequence[Row]) -> list[Ratio]:
    by = {(r.round, r.run.concurrency, r.setup): r for r in rows}
    ratios = []
    for round_, concurrency in sorted({(r.round, r.run.concurrency) for r in rows}):
        at = {setup: by.get((round_, concurrency, setup)) for setup in SETUPS}
        one, two, peer = at[ONE], at[TWO], at[PEER]
        rate = {setup: row.run.req_per_s if row else None for setup, row in at.items()}
        ratios.append(
            Ratio(
                round=round_,
                concurrency=concurrency,
                cpu_per_request_two_over_one=_ratio(two.cpu_us_per_request if two else None, one.cpu_us_per_request if one else None),
                req_per_s_two_over_one=_ratio(rate[TWO], rate[ONE]),
                req_per_s_one_over_peer=_ratio(rate[ONE], rate[PEER] if peer else None),
                req_per_s_two_over_peer=_ratio(rate[TWO], rate[PEER] if peer else None),
            )
        )
    return ratios


# -- reporting -------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _progress(row: Row) -> str:
    return (
        f"  round {row.round} {row.setup:>21} c={row.run.concurrency}: {row.run.req_per_s:,.0f} req/s, "
        f"set-up {row.setup_cores:.2f} cores, {_fmt(row.cpu_us_per_request, ',.0f')} µs/req, machine busy {row.machine_busy_cores:.2f}"
    )


def render(result: Result) -> str:
    """The markdown report: every loop, the ratios, how it was measured."""
    lines = [
        f"`{result.command}` at commit {result.commit} ({result.code}); {result.cpu_count} CPUs; peer: {result.peer or 'left out'}.",
        "",
        "| round | set-up | concurrency | requests | errors | req/s | P50 ms | P99 ms | set-up cores | set-up CPU µs/req "
        "| cores: engine / client / not ours | machine busy cores | load average start → end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.round} | {r.setup} | {r.run.concurrency} | {r.run.requests:,} | {r.run.errors} | {r.run.req_per_s:,.0f} | {r.run.p50_ms:.2f} "
            f"| {r.run.p99_ms:.2f} | {r.setup_cores:.2f} | {_fmt(r.cpu_us_per_request, ',.0f')} "
            f"| {r.run.cores['simulator']:.2f} / {r.run.cores['client']:.2f} / {r.others_cores:.2f} | {r.machine_busy_cores:.2f} "
            f"| {r.load_average_start[0]:.2f} → {r.load_average_end[0]:.2f} |"
        )
    lines += [
        "",
        "| round | concurrency | CPU/req workers 2 / workers 1 | req/s workers 2 / workers 1 | req/s workers 1 / vllm-router | req/s workers 2 / vllm-router |",
        "|---|---|---|---|---|---|",
    ]
    for q in result.ratios:
        lines.append(
            f"| {q.round} | {q.concurrency} | {_fmt(q.cpu_per_request_two_over_one, '.2f', 'x')} | {_fmt(q.req_per_s_two_over_one, '.2f', 'x')} "
            f"| {_fmt(q.req_per_s_one_over_peer, '.2f', 'x')} | {_fmt(q.req_per_s_two_over_peer, '.2f', 'x')} |"
        )
    processes = sorted({f"{r.setup}: {', '.join(name.split()[0] for name in r.setup_processes)}" for r in result.rows if r.setup_processes})
    lines += [
        "",
        f"'{result.message}', max_tokens {result.max_tokens}, non-streaming, closed loop on keep-alive connections "
        f"({result.parameters['warmup']} warm-up requests per loop, then up to {result.parameters['seconds']} s). {result.engine}. "
        "Set-up CPU sums every process of the set-up (" + "; ".join(processes) + "). 'machine busy cores' counts every process "
        "on the machine, from /proc/stat, warm-up included; 'not ours' is what is left of it after the engine, the set-up and this "
        f"client. Load average (1 min) {result.load_average_start} at the start, {result.load_average_end} at the end. "
        f"Wall time {result.wall_s:.0f} s.",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add = parser.add_argument
    add("--concurrency", type=int, nargs="+", default=[64, 128], metavar="N", help="closed-loop concurrencies (default 64 128)")
    add_seconds_arg(parser, 4.0, "time bound of each measured loop, > 0")
    add("--requests", type=int, default=50_000, help="count bound of each measured loop (default %(default)s)")
    add_warmup_arg(parser, 500, "unmeasured requests before each loop", int)
    add("--rounds", type=int, default=2, help="every set-up this many times, the order reversed every other round (default %(default)s)")
    add("--peer", default="auto", metavar="PATH|auto|none", help="vllm-router: auto finds it beside this Python or on PATH, none leaves it out (default %(default)s)")
    add_out_arg(parser, RESULTS_DIR, "directory of workers.json and workers.md")
    return parser


def _peer(choice: str) -> Path | None:
    """The vllm-router to run, from ``--peer``; SystemExit when it was asked for and is not there."""
    if choice == "none":
        return None
    peer = find_peer() if choice == "auto" else Path(choice)
    if peer is None or not peer.exists():
        raise SystemExit("vllm-router not found: pip install -e '.[bench]', or --peer PATH, or --peer none")
    return peer


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.concurrency + [args.requests, args.rounds]) < 1 or args.seconds <= 0 or args.warmup < 0:
        raise SystemExit("python -m bench workers: --concurrency, --requests and --rounds must be >= 1, --seconds > 0, --warmup >= 0")
    peer = _peer(args.peer)
    command = " ".join(["python -m bench workers", *(sys.argv[2:] if argv is None else argv)])
    options = Options(sorted(set(args.concurrency)), args.seconds, args.requests, args.warmup, args.rounds, peer, command)
    result = Result(
        command=command,
        code=code_version(),
        commit=git_commit(),
        cpu_count=cpu_count(),
        peer=peer_version(peer),
        engine=f"One simulated engine, profile 'instant' ({POOL_CAP} seats, no GPU time)",
        message=MESSAGE,
        max_tokens=MAX_TOKENS,
        parameters={**asdict(options), "peer": str(peer), "concurrencies": list(options.concurrencies)},
        load_average_start=_load_average(),
    )
    said = "the simulator, vllm-router and tailguard (supervisor, workers, redis-server) were stopped"
    return run_and_report(measure, options, result, said=said, render=render, out=args.out, stem="workers")
