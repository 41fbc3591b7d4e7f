"""``python -m bench chaos``: attack tailguard the way production will, and check what must hold.

Real processes on 127.0.0.1: one simulator process serves three engines
(``a`` and ``b``, latency profile, form the interactive pool, 8 seats each;
``c``, throughput profile, the batch pool) and an admin port that switches
their fault modes (``bench.sim.faults``); the engines require a key
(vLLM's ``--api-key``), which tailguard sends from its environment
(``api_key_env``). tailguard runs in front from a generated config
(end-to-end timeout 8 s, so hung requests end in bounded time; everything
else as shipped). An attack that needs another config (API keys, ``[cluster]``
on a redis-server the lab starts, the shipped timeouts, the gRPC gate as
shipped: ``bench.chaos.lab.Setup``) runs on a tailguard restarted with it.

Each attack (``bench.chaos.catalog`` lists them in run order) is one phase:
normal traffic (20 req/s short chats, half streamed) starts, the attack
runs, normal traffic goes on for a while after the attack's fault ended,
then the benchmark waits for tailguard and the engines to settle. One row
per attack:

- requests sent, and their outcomes by status and error code;
- normal requests that failed (collateral damage of the attack);
- requests without exactly one terminal answer (``bench.chaos.client`` says
  what counts): must be 0;
- seats in use / queued in tailguard's pools (its ``/metrics``) and
  sequences running or waiting in the engines (theirs) after settling: must be 0;
- tailguard's open descriptors and RSS (``/proc/PID``) before and after;
- recovery: from the fault's end until normal requests succeed again;
- and in its details what the attack itself checks (issue 32's rows: the
  figures that say whether each defect is there, with ``check_failures``).

The run prints its exact command and the commit it measured, and writes
JSON and a markdown table under ``bench/results/chaos/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import trio

from bench.chaos.attacks import BATCH_MAX_TOKENS, NORMAL_MAX_TOKENS, Attack, Phase, normal_spec
from bench.chaos.catalog import ATTACKS
from bench.chaos.client import Answer, HttpPool, RequestSpec, recovery_s, send, tally
from bench.chaos.lab import (
    BATCH_SEATS,
    DEFAULT,
    ENGINE_KEY,
    ENGINE_KEY_ENV,
    FD_SLACK,
    MAX_NORMAL_REQUESTS,
    QUICK,
    RESULTS,
    SEATS_PER_ENGINE,
    SETTLE_MAX_S,
    Lab,
    Options,
    PhaseResult,
    ProcStats,
    Result,
    Setup,
    proc_stats,
    tailguard_config,
)
from bench.chaos.report import render, write_outputs
from bench.harness.cli import add_out_arg, add_seed_arg, driver_parser, run_trio
from bench.harness.grpc import AsyncioThread
from bench.harness.procs import add_serve_arg, free_ports, log_tail, start_process, start_tailguard, stop, wait_ready
from bench.harness.report import git_commit, json_safe
from tailguard.sim.params import PROFILES


async def wait_admin(port: int, sim: trio.Process) -> None:
    """Poll the simulator's admin port until it answers."""
    with trio.fail_after(10):
        while (await HttpPool(port).request(RequestSpec("/_sim/faults", b"", method="GET", headers=()), 1.0, keep=False)).status != 200:
            if sim.returncode is not None:
                raise RuntimeError(f"the simulator exited with {sim.returncode}")
            await trio.sleep(0.05)


def capacities() -> dict[str, float]:
    """Requests a second each pool can finish, from the engine model.

    interactive: two latency engines, 8 seats each, normal requests (32
    tokens); batch: one throughput engine, 16 seats, batch requests.
    """

    def rate(profile: str, seats: int, tokens: int) -> float:
        step_s = PROFILES[profile].step_ms(seats, 0, seats * (20 + tokens // 2)) / 1000
        return seats / (tokens * step_s)

    return {
        "interactive": round(2 * rate("latency", SEATS_PER_ENGINE, NORMAL_MAX_TOKENS), 1),
        "batch": round(rate("throughput", BATCH_SEATS, BATCH_MAX_TOKENS), 1),
    }


# -- one phase ---------------------------------------------------------------------------


async def normal_traffic(lab: Lab, phase: Phase, done: trio.Event) -> None:
    """20 short chats a second (half streamed) until ``done``; returns when all are answered."""
    start = time.perf_counter()
    headers = lab.setup.normal_headers
    async with trio.open_nursery() as nursery:
        for i in range(MAX_NORMAL_REQUESTS):
            if done.is_set():
                break
            nursery.start_soon(send, lab.pool, normal_spec(i, headers), "normal", lab.client_timeout, phase.answers)
            with trio.move_on_at(trio.current_time() + max(0.0, start + (i + 1) / lab.options.normal_rate - time.perf_counter())):
                await done.wait()


async def warm_up(lab: Lab, seconds: float = 2.0) -> None:
    """Normal traffic, unrecorded: connection pools fill before the first look."""
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(normal_traffic, lab, Phase(), done)
        await trio.sleep(seconds)
        done.set()


async def restart_tailguard(lab: Lab, setup: Setup, *, warm: bool = True) -> None:
    """A new tailguard process on ``setup``, warmed up: no earlier attack's verdict on an endpoint carries over."""
    await lab.use(setup)
    if warm:
        await warm_up(lab, 0.5)


async def watch_rss(pid: int, peak: list[float]) -> None:
    while True:
        peak[0] = max(peak[0], proc_stats(pid, ()).rss_mib)
        await trio.sleep(0.25)


async def quiet_look(lab: Lab) -> ProcStats:
    """tailguard's process once this client's idle connections are closed (they are not tailguard's to keep)."""
    await lab.pool.aclose()
    await trio.sleep(0.3)
    return proc_stats(lab.tailguard.pid, list(lab.engines.values()), (lab.tg_port, lab.grpc_port))


async def run_phase(lab: Lab, attack: Attack) -> PhaseResult:
    restarted = await lab.ensure_tailguard()
    if attack.start_fault is not None:
        await lab.set_fault("a", attack.start_fault)
    if attack.setup != lab.setup or attack.start_fault is not None or (attack.fresh and restarted is None):
        # Warming up would send requests to an engine that is down from the start.
        await restart_tailguard(lab, attack.setup, warm=attack.start_fault is None)
    pid = lab.tailguard.pid
    before = await quiet_look(lab)
    counted_before = await lab.tailguard_sum("tailguard_requests_total")
    log_from = lab.tg_log.stat().st_size
    retries_before = lab.pool.stale_retries
    phase = Phase()
    peak = [before.rss_mib]
    started = time.perf_counter()
    async with trio.open_nursery() as watchers:
        watchers.start_soon(watch_rss, pid, peak)
        done = trio.Event()
        async with trio.open_nursery() as traffic:
            if attack.normal:
                traffic.start_soon(normal_traffic, lab, phase, done)
            await trio.sleep(lab.options.pre)
            await attack.run(lab, phase)
            await trio.sleep(lab.options.post)
            done.set()
        watchers.cancel_scope.cancel()
    seats, queued, engine, settle_s = await _settle(lab, pid, before)
    after = await quiet_look(lab)
    counted_after = await lab.tailguard_sum("tailguard_requests_total")
    fault_start = phase.fault_start or started
    fault_end = phase.fault_end or fault_start
    normal = [a for a in phase.answers if a.group == "normal"]
    failed = [a for a in normal if not a.ok]
    extra = _phase_extra(lab, phase, started, restarted, log_from)
    return PhaseResult(
        attack=attack.name,
        description=attack.description,
        wall_s=round(time.perf_counter() - started, 1),
        requests=len(phase.answers),
        outcomes=tally(phase.answers),
        normal=len(normal),
        normal_failed=tally(failed),
        normal_failed_during_fault=sum(1 for a in failed if fault_start <= a.sent_at <= fault_end),
        no_terminal=sum(1 for a in phase.answers if not a.terminal),
        seats=seats,
        queued=queued,
        engine_busy=engine,
        settle_s=round(settle_s, 2),
        before=before,
        after=after,
        rss_max_mib=max(peak[0], after.rss_mib),
        recovery_s=recovery_s(normal, fault_end),
        counted_by_tailguard=None if counted_before is None or counted_after is None else int(counted_after - counted_before),
        log_errors=_log_errors(lab.tg_log, log_from),
        tailguard_exit=lab.tailguard.returncode,
        stale_retries=lab.pool.stale_retries - retries_before,
        extra=extra | _attack_summary(phase.answers),
    )


async def _settle(lab: Lab, pid: int, before: ProcStats) -> tuple[float | None, float | None, float | None, float]:
    """Wait until tailguard's seats, queues and engines are idle and its fds back (or SETTLE_MAX_S): those counts, and the wait."""
    settle_start = time.perf_counter()
    await lab.pool.aclose()  # this client's own keep-alive connections are not tailguard's to count
    while True:
        seats, queued, engine = await lab.busy()
        # Idle keep-alive connections to the engines close after the router's
        # expiry (5 s); settling waits for that too, as for seats.
        now = proc_stats(pid, list(lab.engines.values()), (lab.tg_port, lab.grpc_port))
        fds_back = (now.fds - now.close_wait) - (before.fds - before.close_wait) <= FD_SLACK
        if (seats == queued == engine == 0 and fds_back) or time.perf_counter() - settle_start > SETTLE_MAX_S:
            break
        await trio.sleep(0.1)
    return seats, queued, engine, time.perf_counter() - settle_start


def _phase_extra(lab: Lab, phase: Phase, started: float, restarted: int | None, log_from: int) -> dict[str, Any]:
    """The attack's own extras, plus samples of answers that never ended and, if tailguard died, its log."""
    extra = dict(phase.extra)
    broken = [a for a in phase.answers if not a.terminal][:5]
    if broken:
        extra["no_terminal_samples"] = [
            {"group": a.group, "outcome": a.outcome, "after_s": round(a.elapsed, 2), "sent_s": round(a.sent_at - started, 2), "request": a.detail}
            for a in broken
        ]
    if restarted is not None:
        extra["tailguard_exited_before_phase"] = restarted
    if lab.tailguard.returncode is not None:
        log = _log_since(lab.tg_log, log_from)
        first = max(0, log.find("Traceback"))
        extra["tailguard_log_tail"] = log[first : first + 4000] + ("\n[...]\n" + log[-2000:] if len(log) > first + 4000 else "")
        print(f"--- tailguard exited with {lab.tailguard.returncode}; its log ---\n{extra['tailguard_log_tail']}", file=sys.stderr)
    return extra


def _attack_summary(answers: Sequence[Answer]) -> dict[str, Any]:
    attack = [a for a in answers if a.group != "normal"]
    return {"attack_outcomes": tally(attack)} if attack else {}


def _log_errors(path: Path, start: int) -> int:
    with path.open("rb") as log:
        log.seek(start)
        return sum(1 for line in log if b"ERROR" in line or b"Traceback" in line)


def _log_since(path: Path, start: int) -> str:
    with path.open("rb") as log:
        log.seek(start)
        return log.read().decode("utf-8", "replace")


# -- the run -------------------------------------------------------------------------------


def _key(name: str) -> str:
    """An attack's name as typed: any case, spaces, hyphens or underscores ("engine-kill")."""
    return "".join(c for c in name.lower() if c.isalnum())


def selected(options: Options) -> list[Attack]:
    if not options.attacks:
        return list(ATTACKS)
    by_key = {_key(a.name): a for a in ATTACKS}
    return [by_key[_key(name)] for name in options.attacks]


async def measure(options: Options, command: str) -> Result:
    tg_port, grpc_port, admin_port, a, b, c = free_ports(6)
    engines = {"a": a, "b": b, "c": c}
    result = Result(command, git_commit(), len(os.sched_getaffinity(0)), json_safe(asdict(options)), capacities(), [])
    with tempfile.TemporaryDirectory(prefix="tailguard-chaos-") as tmp, AsyncioThread() as aio:
        sim_log, tg_log = Path(tmp) / "sim.log", Path(tmp) / "tailguard.log"
        with sim_log.open("wb") as sim_out, tg_log.open("ab") as tg_out:
            try:
                async with trio.open_nursery() as nursery:
                    spec = f"{a}:latency,{b}:latency,{c}:throughput"
                    command_line = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--admin-port", str(admin_port)]
                    sim = await start_process(nursery, [*command_line, "--seed", str(options.seed), "--api-key", ENGINE_KEY], sim_out)
                    for port in engines.values():
                        await wait_ready(port, sim, "the simulator")
                    await wait_admin(admin_port, sim)
                    config = Path(tmp) / "config.toml"
                    config.write_text(tailguard_config(tg_port, grpc_port, engines))
                    tailguard = await start_tailguard(nursery, config, log=tg_out, extra_args=options.serve_args, env={ENGINE_KEY_ENV: ENGINE_KEY})
                    await wait_ready(tg_port, tailguard, "tailguard")
                    lab = Lab(
                        options, tg_port, grpc_port, admin_port, engines, config, tg_log, sim, tailguard,
                        HttpPool(tg_port), aio, nursery, tg_out, Path(tmp), capacity=capacities(),
                    )  # fmt: skip
                    await warm_up(lab)
                    for attack in selected(options):
                        print(f"  {attack.name} ...", file=sys.stderr, flush=True)
                        phase = await run_phase(lab, attack)
                        result.phases.append(phase)
                        print(f"    {_progress(phase)}", file=sys.stderr, flush=True)
                        if sim.returncode is not None:
                            raise RuntimeError(f"the simulator exited with {sim.returncode}")
                    await lab.pool.aclose()
                    await stop(lab.tailguard)
                    nursery.cancel_scope.cancel()
            except Exception:
                print(f"--- simulator log ---\n{log_tail(sim_log)}\n--- tailguard log ---\n{log_tail(tg_log)}", file=sys.stderr)
                raise
    return result


def _progress(p: PhaseResult) -> str:
    return (
        f"{p.requests} requests, {p.no_terminal} without one terminal answer, normal failed "
        f"{sum(p.normal_failed.values())}/{p.normal}, after: seats {p.seats} queue {p.queued} engines {p.engine_busy}, "
        f"fds {p.before.fds}->{p.after.fds}, RSS {p.before.rss_mib:.0f}->{p.after.rss_mib:.0f} MiB, "
        f"recovery {p.recovery_s}, {p.wall_s:.0f} s"
    )


def checks(result: Result, fd_slack: int = FD_SLACK, rss_slack_mib: float = 30.0) -> list[str]:
    """What must hold, phase by phase: each failure as one line (empty: all held)."""
    failures = []
    for p in result.phases:
        if p.no_terminal:
            failures.append(f"{p.attack}: {p.no_terminal} requests without exactly one terminal answer")
        if p.seats or p.queued or p.engine_busy or None in (p.seats, p.queued, p.engine_busy):
            failures.append(f"{p.attack}: after settling, seats {p.seats}, queued {p.queued}, engine sequences {p.engine_busy}")
        grown = (p.after.fds - p.after.close_wait) - (p.before.fds - p.before.close_wait)
        if grown > fd_slack:
            failures.append(f"{p.attack}: tailguard's fds {p.before.fds} -> {p.after.fds}, {grown} more besides CLOSE-WAIT client sockets")
        if "rss_mib_after_each_set" not in p.extra and p.after.rss_mib > p.before.rss_mib + rss_slack_mib:  # the row judges its own
            failures.append(f"{p.attack}: tailguard's RSS {p.before.rss_mib:.0f} -> {p.after.rss_mib:.0f} MiB")
        if p.recovery_s is None:
            failures.append(f"{p.attack}: normal requests still failing {result.options['post']} s after the fault's end")
        if p.tailguard_exit is not None or "tailguard_exited_before_phase" in p.extra:
            failures.append(f"{p.attack}: tailguard exited")
        failures += [f"{p.attack}: {line}" for line in p.extra.get("check_failures", ())]
    return failures


def notes(result: Result) -> list[str]:
    """What the run saw that is not this benchmark's to fail on."""
    lines = []
    worst = max(result.phases, key=lambda p: p.after.close_wait, default=None)
    if worst is not None and worst.after.close_wait > 10:
        lines.append(
            f"tailguard keeps client sockets the client closed (CLOSE-WAIT) open for a while: {worst.after.close_wait} "
            f"after '{worst.attack}' (each holds an fd; the HTTP server's, listed in the issue as the data-plane issue's)."
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    quick = (
        "shorter windows and fewer requests (~6.5 minutes here; the default run takes ~4 minutes before issue 32's rows, "
        "and those up to ~18 more while the defects they look for are there)"
    )
    parser = driver_parser(__name__, __doc__, quick=quick)
    parser.add_argument(
        "--attacks", default="", help=f"comma-separated subset, in run order; default all: {', '.join(a.name for a in ATTACKS)}"
    )
    parser.add_argument(
        "--overload-pool",
        choices=("batch", "interactive"),
        default="batch",
        help="the pool the 10x overload aims at; the interactive pool's 10x (~600 req/s) saturates a 2-core machine's "
        "CPU, client included (default %(default)s)",
    )
    parser.add_argument(
        "--grpc-calls",
        default=None,
        help="the gRPC flood's rounds, comma-separated concurrent calls (default 2 and 5 times the shipped gate, server.grpc_max_calls: "
        f"{','.join(map(str, DEFAULT.grpc_calls))}; --quick {','.join(map(str, QUICK.grpc_calls))}); the flood runs with that gate in force",
    )
    add_seed_arg(parser, 0, "the fuzz, the cancel storm and the engines")
    add_out_arg(parser, RESULTS, "directory for JSON and markdown")
    parser.add_argument("--name", default=None, help="base name of the outputs (default chaos, or chaos-quick)")
    add_serve_arg(parser)
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    names = tuple(n.strip() for n in args.attacks.split(",") if n.strip())
    unknown = [n for n in names if _key(n) not in {_key(a.name) for a in ATTACKS}]
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}; choose from {', '.join(a.name for a in ATTACKS)}")
    base = QUICK if args.quick else DEFAULT
    if args.grpc_calls:
        try:
            floods = tuple(int(n) for n in args.grpc_calls.split(",") if n.strip())
        except ValueError:
            parser.error(f"--grpc-calls: comma-separated integers, got {args.grpc_calls!r}")
        if not floods or min(floods) < 1:
            parser.error(f"--grpc-calls: at least one round of at least 1 call, got {args.grpc_calls!r}")
        base = replace(base, grpc_calls=floods)
    return replace(base, seed=args.seed, attacks=names, overload_pool=args.overload_pool, serve_args=tuple(args.serve_arg), out=args.out, name=args.name or base.name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    options = options_from(parser.parse_args(argv), parser)
    command = shlex.join(["python", "-m", "bench", "chaos", *argv])
    print(f"command: {command}", flush=True)
    started = time.perf_counter()
    result = run_trio(measure, options, command, said="the simulator and tailguard were stopped")
    if result is None:
        return 130
    result.wall_s = round(time.perf_counter() - started, 1)
    result.checks = checks(result)
    result.notes = notes(result)
    text = render(result)
    print(text)
    for path in write_outputs(result, text, options.out, options.name):
        print(f"wrote {path}")
    return 0 if not result.checks else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
