"""``python -m bench router_overhead``: what tailguard adds to a request, beside calling the engine directly.

One run, one machine, side by side: the simulator serves two engines in the
``instant`` profile (no GPU cost, so every millisecond measured is HTTP, JSON
and scheduling), and tailguard runs in front of them from a temporary
config. A closed loop of short, non-streaming chat completions (interactive
class) goes first straight to engine 1, then through tailguard, at each
concurrency; the difference is the router's overhead. Every request's
prompt is its own (a nonce first, ``bench.harness.unique``), so placement
hashes a new prefix key each time, as it would for real traffic. The router's CPU time
per request comes from ``/proc/PID/stat``; the simulator's and this client's
CPU are reported too, so a reader can tell which process was the limit.

The load client is lean on purpose (raw Trio sockets, keep-alive HTTP/1.1,
hand-parsed responses): on a two-core machine an httpx client would compete
with the router for CPU and inflate what is attributed to it. The helpers
here (client, processes, config) are shared with ``bench.quick_mixed.run``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import trio

from bench.harness.cli import add_json_arg, add_seconds_arg, add_warmup_arg, comma_separated, driver_parser, run_trio
from bench.harness.clocks import cpu_count
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, Plan, RunResult, measure_closed_loop, runs_table
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import RESULTS_ROOT, add_serve_arg, free_ports, log_tail, start_simulator, start_tailguard, stop, wait_ready
from bench.harness.report import md_table, save_json
from bench.harness.toml import TomlTable
from bench.harness.unique import unique_chat
from tailguard.sim import SimResponse
from tailguard.sim.http import serve as serve_sim

DEFAULT_JSON = RESULTS_ROOT / "router_overhead.json"


# -- a lean keep-alive HTTP/1.1 client ---------------------------------------


# -- processes ------------------------------------------------------------------


# -- statistics -------------------------------------------------------------------


# -- the closed loop -----------------------------------------------------------------


# -- the run -------------------------------------------------------------------


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
    tracing: float | None  # [tracing]'s sample_ratio; None: off
    warmup_requests: int
    seconds_bound: float
    cpu_count: int
    runs: list[RunResult]
    overhead: list[Overhead]


async def measure(plan: Plan) -> Result:
    """Start the simulator and tailguard, run every (concurrency, target), tear it all down."""
    sim_port, batch_port, tg_port, grpc_port, otlp_port = free_ports(5)
    # --tracing: tailguard exports OTLP/HTTP to a receiver in this process (its CPU is the client's), which answers 200.
    sections: TomlTable = {}
    if plan.tracing is not None:
        sections = {"tracing": {"enabled": True, "endpoint": f"http://127.0.0.1:{otlp_port}/v1/traces", "sample_ratio": plan.tracing}}
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}
    targets = {"direct": sim_port, "tailguard": tg_port}
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="tailguard-bench-") as tmp:
        config = Path(tmp) / "config.toml"
        pool = partial(PoolSpec, max_concurrency=1024, max_queue=4096)
        config.write_text(
            tailguard_config(tg_port, grpc_port, pool("interactive", [(sim_port, 1024)]), pool("batch", [(batch_port, 1024)]), sections=sections)
        )
        sim_log, tg_log = Path(tmp) / "sim.log", Path(tmp) / "tailguard.log"
        with sim_log.open("wb") as sim_out, tg_log.open("wb") as tg_out:
            try:
                async with trio.open_nursery() as nursery:
                    sim = await start_simulator(nursery, [(sim_port, "instant"), (batch_port, "instant")], log=sim_out)
                    await wait_ready(sim_port, sim, "the simulator")
                    await wait_ready(batch_port, sim, "the simulator")
                    if plan.tracing is not None:
                        await nursery.start(serve_sim, _accept_export, "127.0.0.1", otlp_port)
                    tg = await start_tailguard(nursery, config, log=tg_out, extra_args=plan.serve_args)
                    await wait_ready(tg_port, tg, "tailguard")
                    pids = {"simulator": sim.pid, "tailguard": tg.pid}
                    for concurrency in plan.concurrencies:
                        for target, port in targets.items():
                            request = unique_chat(port, payload, "router-overhead", target, concurrency)
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
        tracing=plan.tracing,
        warmup_requests=plan.warmup,
        seconds_bound=plan.seconds,
        cpu_count=cpu_count(),
        runs=runs,
        overhead=_overheads(runs),
    )


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


def _progress(run: RunResult) -> str:
    return f"  {run.target:>9} c={run.concurrency:<3} n={run.requests} P50 {run.p50_ms:.2f} ms P99 {run.p99_ms:.2f} ms {run.req_per_s:,.0f} req/s"


# -- reporting -------------------------------------------------------------------


RUNS_HEADER = ("target", "concurrency", "requests", "errors", "P50 ms", "P99 ms", "req/s", "cores: sim / tailguard / client", "router CPU ms/req")


def render_table(result: Result) -> str:
    runs = runs_table(result.runs, RUNS_HEADER, ".3f")
    added = md_table(
        ["concurrency", "added P50 ms", "added P99 ms", "req/s direct", "req/s tailguard"],
        (
            (o.concurrency, f"{o.added_p50_ms:+.3f}", f"{o.added_p99_ms:+.3f}", f"{o.req_per_s_direct:,.0f}", f"{o.req_per_s_tailguard:,.0f}")
            for o in result.overhead
        ),
    )
    return "\n".join([*runs, "", *added])


async def _accept_export(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
    """An OTLP/HTTP receiver that keeps nothing: every export succeeds (an empty ExportTraceServiceResponse)."""
    return SimResponse(200, [("content-type", "application/x-protobuf")])


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument(
        "--requests", type=int, default=10_000, help="requests per measured run at the highest concurrency; concurrency 1 runs a fifth of it (default %(default)s)"
    )
    add_seconds_arg(parser, 15.0, "time bound of each measured run")
    add_warmup_arg(parser, 500, "unmeasured requests before each run", int)
    parser.add_argument("--concurrency", type=comma_separated(int), default="1,64", help="comma-separated concurrencies (default %(default)s)")
    add_serve_arg(parser)
    parser.add_argument(
        "--tracing", nargs="?", type=float, const=1.0, default=None, metavar="RATIO",
        help="[tracing] on, sample_ratio RATIO (default 1): tailguard exports spans over OTLP/HTTP to a receiver run here",
    )
    add_json_arg(parser, DEFAULT_JSON)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    concurrencies: list[int] = args.concurrency
    if args.requests < 1 or args.seconds <= 0 or args.warmup < 0 or not concurrencies or min(concurrencies) < 1:
        parser.error("--requests and --concurrency must be >= 1, --seconds > 0, --warmup >= 0")
    if args.tracing is not None and not 0 <= args.tracing <= 1:
        parser.error("--tracing RATIO must be from 0 to 1")
    top = max(concurrencies)
    plan = Plan(
        concurrencies=concurrencies,
        requests=lambda c: args.requests if c == top else max(1, args.requests // 5),
        seconds=args.seconds,
        warmup=args.warmup,
        serve_args=args.serve_arg,
        tracing=args.tracing,
    )
    started = time.perf_counter()
    result = run_trio(measure, plan, said="the simulator and tailguard were stopped")
    if result is None:
        return 130
    print(render_table(result))
    flags = (" ".join(plan.serve_args) or "(default flags)") + ("" if plan.tracing is None else f", [tracing] on (sample_ratio {plan.tracing:g})")
    print(
        f"\n'{MESSAGE}' after a nonce unique to each request, max_tokens {MAX_TOKENS}, non-streaming chat (interactive class); engines in the "
        f"'instant' profile; tailguard serve {flags}; closed loop on keep-alive connections, {plan.warmup} "
        f"warm-up requests per run; {result.cpu_count} CPUs shared by the simulator, tailguard and this client. "
        f"Wall time {time.perf_counter() - started:.0f} s."
    )
    save_json(args.json, asdict(result))
    return 0

