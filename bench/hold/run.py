"""``python -m bench hold``: the router's memory while it holds N HTTP SSE streams, and its GC pauses while it relays.

One tailguard process serves HTTP only (``serve --no-grpc``) from a
temporary config; simulated engines run in other processes, so only the
router's own memory is measured. Two phases:

1. Hold: N streaming chats (default 10,000; max_tokens 256, so the batch
   class) against slow engines (one step every ``--step-ms``, so a stream
   gets a token a step and stays open for minutes), one engine per 1,000
   streams so no engine's seats are the limit, two engines a simulator
   process, pool caps above N. The client is lean: one raw Trio socket per
   stream, the request sent once, read every ``--read-pause`` seconds (a
   slow reader). A stream counts as open once its first SSE event arrived
   (routed, backend connected, relayed end to end). Opening is paced (at
   most 1,024 without a response head). Then the streams are held
   ``--seconds`` while they relay, the client closes them all, and the
   router settles. tailguard's VmRSS, VmHWM, threads and fds
   (``/proc/PID``) at idle, at the peak, held, and after; its CPU; its
   garbage-collector pauses while the streams open and while they relay,
   from ``tailguard_gc_pause_seconds`` on its /metrics (scraped before the
   ramp, after it and after the hold); and the latency of ``/health`` on
   the router and on one engine, polled throughout (a stalled event loop
   shows there). The config's connect and health-check timeouts are wider
   than the defaults (10 s and 5 s), so an engine stalled on a shared
   machine is not ejected mid-ramp; the stalls are reported instead.
2. GC thresholds: for each first-generation threshold in ``--relay-gen0``
   (default 700, 10,000 and 50,000; the older generations' as the server
   sets them, ``--gc-older``), a fresh tailguard relays 256 streaming chats
   (max_tokens 128) from an ``instant`` engine, restarted as they end (the
   SSE relay load of ``bench overhead``); events/s, router CPU per event,
   and the GC pause distribution over the window.

The thresholds are set by this benchmark, not by a server option: the
router runs under a bench-side launcher (``bench.hold.router``) whose
thread waits for the server's own ``gc.set_threshold`` at start-up and then
sets the threshold asked for; the child logs the thresholds in force, and
the report quotes that line.

File descriptors: the router needs two per stream (caller and engine), so
N is capped at what its RLIMIT_NOFILE hard limit allows (raised from the
soft limit in this process and in the child); the report says when it did.
Percentiles of GC pauses are bucket bounds (a pause "<= 2 ms"), from the
histogram; the mean is exact.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import trio

from bench.harness import procs
from bench.harness.cli import add_out_arg, add_seconds_arg, driver_parser, run_and_report
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.report import code_version
from bench.harness.toml import TomlTable
from bench.hold.holding import hold_phase
from bench.hold.records import SLOW_SIM, Options, RelayRun, Result
from bench.hold.relay import RELAY_STREAMS, relay_window
from bench.hold.report import render
from bench.hold.router import in_force, parse_thresholds, with_router

RESULTS_DIR = procs.RESULTS_ROOT / "hold"

STREAMS_PER_ENGINE = 1_000  # a vLLM engine seats ~256-1,024 sequences
ENGINES_PER_SIMULATOR = 2  # a process each: a simulator holding 10,000 streams stalled for seconds (its own GC)
INTERACTIVE_CAP = 1024
CONNECT_TIMEOUT_S = 10.0  # the router's to the engines (default 2)
HEALTH_CHECK_TIMEOUT_S = 5.0  # (default 1)


def write_config(path: Path, http_port: int, grpc_port: int, instant: int, slow: Sequence[int], streams: int) -> None:
    """Interactive pool on the instant engine; batch pool on the slow engines, sized to hold every stream."""
    hold = max(streams, 1) + 64
    per_endpoint = math.ceil(hold / len(slow)) + 16
    interactive = PoolSpec("interactive", [(instant, INTERACTIVE_CAP)], max_concurrency=INTERACTIVE_CAP, max_queue=2 * INTERACTIVE_CAP)
    batch = PoolSpec("batch", [(port, per_endpoint) for port in slow], max_concurrency=hold, max_queue=hold)
    # [server]'s connection cap above the streams. Connect and health-check timeouts wide enough that a
    # simulated engine stalled on this shared machine is not ejected (stalls are reported instead).
    sections: TomlTable = {
        "server": {"max_connections": hold + RELAY_STREAMS + 64},
        "timeouts": {"connect_timeout": CONNECT_TIMEOUT_S, "health_check_timeout": HEALTH_CHECK_TIMEOUT_S},
    }
    path.write_text(tailguard_config(http_port, grpc_port, interactive, batch, sections=sections))


async def measure(options: Options) -> Result:
    """Start the engines, then a router for the hold and one per GC threshold; tear everything down on every path."""
    engines = max(1, math.ceil(options.streams / STREAMS_PER_ENGINE))
    http_port, grpc_port, instant, *slow = procs.free_ports(3 + engines)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tailguard-hold-") as tmp:
        config = Path(tmp) / "config.toml"
        write_config(config, http_port, grpc_port, instant, slow, options.streams)
        logs = {name: Path(tmp) / f"{name}.log" for name in ("simulator", "slow-simulator", "tailguard")}
        try:
            with logs["simulator"].open("wb") as sim_out, logs["slow-simulator"].open("wb") as slow_out:
                async with trio.open_nursery() as nursery:
                    sim = await procs.start_simulator(nursery, [(instant, "instant")], log=sim_out)
                    slow_args = ["--max-num-seqs", "20000", "--base-ms", f"{options.step_ms:g}", "--kv-cache-tokens", "100000000"]
                    slow_sims: dict[str, trio.Process] = {}
                    for first in range(0, len(slow), ENGINES_PER_SIMULATOR):
                        spec = ",".join(f"{port}:instant" for port in slow[first : first + ENGINES_PER_SIMULATOR])
                        command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, *slow_args]
                        slow_sims[f"{SLOW_SIM} {len(slow_sims) + 1}"] = await procs.start_process(nursery, command, slow_out)
                    await procs.wait_ready(instant, sim, "the simulator")
                    for index, port in enumerate(slow):
                        await procs.wait_ready(port, slow_sims[f"{SLOW_SIM} {index // ENGINES_PER_SIMULATOR + 1}"], "a slow simulator")
                    slow_pids = {name: process.pid for name, process in slow_sims.items()}
                    hold = None
                    if options.streams > 0:
                        hold = await with_router(
                            config, options.gc_threshold, logs["tailguard"], http_port,
                            lambda tg, pids, said: hold_phase(options, http_port, slow[0], tg, {**pids, **slow_pids}, engines, said, logs["tailguard"]),
                            {"simulator": sim.pid},
                        )  # fmt: skip
                    relay: list[RelayRun] = []
                    for gen0 in options.relay_gen0:
                        thresholds = (gen0, *options.gc_older)
                        relay.append(
                            await with_router(
                                config, thresholds, logs["tailguard"], http_port,
                                lambda tg, pids, said: relay_window(http_port, tg.pid, pids, options.relay_warmup, options.relay_seconds, said),
                                {"simulator": sim.pid},
                            )
                        )  # fmt: skip
                        r = relay[-1]
                        print(f"  relay gc {in_force(r.gc_thresholds)}: {r.events_per_s:,.0f} events/s, router {r.router_cores:.2f} cores, "
                              f"{sum(g.count for g in r.gc)} collections", file=sys.stderr, flush=True)  # fmt: skip
                    for name, process in {"the simulator": sim, **slow_sims}.items():
                        if process.returncode is not None:
                            raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    nursery.cancel_scope.cancel()
        except Exception:
            for name, path in logs.items():
                print(f"--- {name} log ---\n{procs.log_tail(path)}", file=sys.stderr)
            raise
    params: dict[str, object] = {k: (list(v) if isinstance(v, (tuple, list)) else str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    return Result(code_version(), len(os.sched_getaffinity(0)), load_start, os.getloadavg(), resource.getrlimit(resource.RLIMIT_NOFILE), params, hold, relay)


def _ints(text: str) -> list[int]:
    return [int(v.replace("_", "")) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--streams", type=int, default=10_000, help="streams to hold; 0 skips the hold (default %(default)s)")
    add_seconds_arg(parser, 15.0, "how long the streams are held once open")
    parser.add_argument("--step-ms", type=float, default=1000.0, help="the slow engines' step: a token per stream per step (default %(default)s)")
    parser.add_argument("--read-pause", type=float, default=0.5, help="the client's pause between reads of a stream, s (default %(default)s)")
    parser.add_argument("--gc-threshold", type=parse_thresholds, default=None, help="GC thresholds A,B,C in the router during the hold (default: the server's own)")
    parser.add_argument("--relay-gen0", type=_ints, default="700,10000,50000", help="first-generation GC thresholds to try under SSE relay; empty skips (default %(default)s)")
    parser.add_argument("--gc-older", type=_ints, default="20,100", help="the older generations' thresholds in the relay runs (default %(default)s, the server's)")
    parser.add_argument("--relay-warmup", type=float, default=2.0, help="relay load before each window (default %(default)s)")
    parser.add_argument("--relay-seconds", type=float, default=8.0, help="each relay window (default %(default)s)")
    add_out_arg(parser, RESULTS_DIR, "directory of hold.json and hold.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    gc_threshold: tuple[int, int, int] | None = args.gc_threshold
    relay_gen0: list[int] = args.relay_gen0
    older: list[int] = args.gc_older
    if len(older) != 2 or min([*older, *relay_gen0, 1]) < 1:
        parser.error("--gc-older takes two thresholds; thresholds must be >= 1")
    if args.streams < 0 or min(args.seconds, args.step_ms, args.relay_seconds) <= 0 or min(args.read_pause, args.relay_warmup) < 0:
        parser.error("--streams >= 0; --seconds, --step-ms, --relay-seconds > 0; --read-pause, --relay-warmup >= 0")
    options = Options(
        args.streams, args.seconds, args.step_ms, args.read_pause, gc_threshold, relay_gen0, (older[0], older[1]), args.relay_warmup, args.relay_seconds, args.out
    )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs.raise_nofile(hard)  # children inherit it: the router and the slow engines hold a socket per stream
    # This process holds a socket and a task per stream: its own collections
    # (default thresholds, a big heap) would stall the client and its probes,
    # and show as the router's latency. Its garbage waits for the end.
    gc.freeze()
    gc.disable()
    try:
        return run_and_report(measure, options, said="the simulators and the router were stopped", render=render, out=args.out, stem="hold")
    finally:
        gc.enable()
        gc.unfreeze()
