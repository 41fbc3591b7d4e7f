"""Phase 1: N HTTP SSE streams opened (paced), held while they relay, closed; the router sampled throughout."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import trio
import trio.lowlevel

from bench.harness import procs
from bench.harness.client import Source
from bench.harness.clocks import CpuClock, MachineClock
from bench.harness.closed_loop import MESSAGE
from bench.harness.ramp import Ramp, higher, hold_peak, settle
from bench.harness.unique import unique_chat
from bench.hold.gc_pauses import gc_delta, scrape_gc
from bench.hold.records import HoldRun, Options
from bench.hold.streams import HealthProbes, HoldTally, Latencies, hold_one

HOLD_MAX_TOKENS = 256  # above the interactive class's 128: the batch class, the slow engines' pool
MAX_OPENING = 1024  # streams sent but without a response head yet: paces the ramp
FD_MARGIN = 64  # the router's fds besides two per stream: listeners, logs, health checks, the scrape
RAMP_TIMEOUT_S = 60.0
STALL_S = 10.0  # give up the ramp when nothing opened or failed for this long
SETTLE_TIMEOUT_S = 20.0
SETTLE_FD_SLACK = 16
SAMPLE_EVERY_S = 0.5
PROGRESS_EVERY_S = 5.0


async def hold_phase(
    options: Options, port: int, engine_port: int, tg: trio.Process, pids: dict[str, int], engines: int, thresholds: str, log: Path
) -> HoldRun:
    """Open N streams (paced), hold them while they relay, close them all; sample the router throughout."""
    await trio.sleep(1.0)  # start-up garbage collected, health checks settled
    start = time.perf_counter()
    idle = procs.proc_sample(tg.pid, "idle", start, 0)
    target, hard, capped = _fit(options.streams, idle)
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": HOLD_MAX_TOKENS, "stream": True}
    request = unique_chat(port, payload, "hold")
    tally = HoldTally()
    cpu_start = CpuClock.read(pids)
    gc_start = await scrape_gc(port)
    probes = HealthProbes({"router GET /health": port, "one slow engine GET /health": engine_port})
    async with probes, trio.open_nursery() as holders:
        peak, stopped_because = await _ramp(holders, port, request, options.read_pause, target, tally, tg.pid, idle, start)
        ramp_s = time.perf_counter() - start
        cpu_ramp, machine = CpuClock.read(pids), MachineClock.read()
        gc_before, events_before = await scrape_gc(port), tally.events
        peak = await hold_peak(tg.pid, peak, start, lambda: tally.open, options.seconds, SAMPLE_EVERY_S)
        gc_after, cpu_held = await scrape_gc(port), CpuClock.read(pids)
        busy = MachineClock.read().cores_since(machine)
        events = tally.events - events_before
        held = procs.proc_sample(tg.pid, "held", start, tally.open)
        peak = higher(peak, held)
        open_at_end = tally.open
        print(f"  hold: {open_at_end:,} open for {options.seconds:g} s, RSS {held.rss_mib:,.0f} MiB; closing them", file=sys.stderr, flush=True)
        holders.cancel_scope.cancel()
    settle_s, after = await settle(
        tg.pid, idle, start, "after", lambda: 0, threads=False, timeout=SETTLE_TIMEOUT_S, fd_slack=SETTLE_FD_SLACK, every=SAMPLE_EVERY_S
    )
    hold_s = cpu_held.wall - cpu_ramp.wall
    router_cpu = cpu_held.seconds_since(cpu_ramp)["tailguard"]
    return HoldRun(
        requested=options.streams,
        target=target,
        capped_because=capped,
        nofile_hard=hard,
        engines=engines,
        step_ms=options.step_ms,
        read_pause_s=options.read_pause,
        gc_thresholds=thresholds,
        started=tally.started,
        first_event=tally.first_event,
        open_at_hold_end=open_at_end,
        ended_early=tally.ended,
        failed=tally.failed,
        failures=dict(tally.failures),
        ramp_s=ramp_s,
        stopped_because=stopped_because,
        ramp_cores=cpu_ramp.cores_since(cpu_start),
        router_cpu_ms_per_stream_opened=cpu_ramp.seconds_since(cpu_start)["tailguard"] / max(tally.first_event, 1) * 1000,
        rss_kib_per_open_stream=(held.rss_mib - idle.rss_mib) * 1024 / max(open_at_end, 1),
        hold_s=hold_s,
        hold_events_per_s=events / hold_s,
        hold_cores=cpu_held.cores_since(cpu_ramp),
        hold_machine_busy_cores=busy,
        router_cpu_us_per_event=router_cpu / events * 1e6 if events else None,
        gc_ramp=gc_delta(gc_start, gc_before, ramp_s),
        gc=gc_delta(gc_before, gc_after, hold_s),
        settle_s=settle_s,
        fds_left_above_idle=max(0, after.fds - idle.fds),
        samples=[idle, replace(peak, moment="peak (ramp + hold)"), held, after],
        router_log_tail=procs.log_tail(log)[-1500:],
        latencies=[
            Latencies.of("stream: connect + send to the response head (as the client saw it)", tally.head_s),
            Latencies.of("stream: connect + send to the first SSE event (as the client saw it)", tally.first_event_s),
            *(Latencies.of(f"{name} (a probe thread)", seconds) for name, seconds in probes.latencies.items()),
        ],
    )


def _fit(streams: int, idle: procs.ProcSample) -> tuple[int, int, str | None]:
    """The streams the router's RLIMIT_NOFILE hard limit can hold (two fds each), that limit, and why fewer than asked, if so."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fit = (hard - idle.fds - FD_MARGIN) // 2
    target = min(streams, fit)
    capped = None if target == streams else f"RLIMIT_NOFILE hard limit {hard:,}: {idle.fds} fds at idle + 2 a stream + {FD_MARGIN} spare"
    if capped:
        print(f"  hold: {streams:,} streams do not fit; holding {target:,} ({capped})", file=sys.stderr, flush=True)
    return target, hard, capped


async def _ramp(
    holders: trio.Nursery,
    port: int,
    request: Source,
    read_pause: float,
    target: int,
    tally: HoldTally,
    pid: int,
    idle: procs.ProcSample,
    start: float,
) -> tuple[procs.ProcSample, str]:
    """Open ``target`` streams in ``holders``, at most MAX_OPENING waiting at once, until all opened or the ramp gives up.

    Returns the router's peak sample so far and why the ramp stopped.
    """
    peak = idle
    ramp = Ramp(target, RAMP_TIMEOUT_S, STALL_S, started=start)
    with trio.move_on_after(RAMP_TIMEOUT_S):
        printed_at, sampled_at = start, start
        launched = 0
        while True:
            while launched < target and tally.waiting < MAX_OPENING:
                holders.start_soon(hold_one, port, request(), read_pause, tally)
                launched += 1
                if launched % 64 == 0:
                    await trio.lowlevel.checkpoint()  # let the connects go out
            await trio.sleep(0.01)
            now = time.perf_counter()
            if now - sampled_at >= SAMPLE_EVERY_S:
                peak = higher(peak, procs.proc_sample(pid, "peak (ramp + hold)", start, tally.open))
                sampled_at = now
            if now - printed_at >= PROGRESS_EVERY_S:
                print(f"  hold: {tally.open:,} open, {tally.failed} failed, RSS {peak.rss_mib:,.0f} MiB peak", file=sys.stderr, flush=True)
                printed_at = now
            if ramp.done(tally.first_event + tally.failed + tally.ended, now):
                break
    return peak, ramp.stopped_because
