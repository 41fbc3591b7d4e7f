"""Phase 2: the SSE relay load of ``bench overhead`` through a router under one GC threshold; its events/s, CPU and GC pauses."""

from __future__ import annotations

from dataclasses import asdict

import trio

from bench.harness import procs
from bench.harness.client import LoadCounters, sse_client
from bench.harness.clocks import CpuClock, MachineClock
from bench.harness.closed_loop import MESSAGE
from bench.harness.unique import unique_chat
from bench.hold.gc_pauses import gc_delta, scrape_gc
from bench.hold.records import RelayRun

RELAY_STREAMS = 256
RELAY_MAX_TOKENS = 128  # the interactive class's max_output_tokens


async def relay_window(port: int, pid: int, pids: dict[str, int], warmup: float, seconds: float, thresholds: str) -> RelayRun:
    """RELAY_STREAMS streaming chats restarted as they end; GC pauses and CPU over the window after the warm-up."""
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": RELAY_MAX_TOKENS, "stream": True}
    request = unique_chat(port, payload, "relay", thresholds)
    counters = LoadCounters()
    deadline = trio.current_time() + warmup + seconds + 30.0  # the clients' own bound; cancelled after the window
    async with trio.open_nursery() as load:
        for _ in range(RELAY_STREAMS):
            load.start_soon(sse_client, port, request, deadline, counters)
        await trio.sleep(warmup)
        gc_before, before, machine = await scrape_gc(port), CpuClock.read(pids), MachineClock.read()
        at_start = LoadCounters(**asdict(counters))
        await trio.sleep(seconds)
        gc_after, after = await scrape_gc(port), CpuClock.read(pids)
        busy = MachineClock.read().cores_since(machine)
        at_end = LoadCounters(**asdict(counters))
        load.cancel_scope.cancel()
    done = at_end.streams_done - at_start.streams_done
    events = at_end.events - at_start.events - done  # a finished stream's [DONE] is not a relayed event
    wall = after.wall - before.wall
    cpu = after.seconds_since(before)["tailguard"]
    return RelayRun(
        gc_thresholds=thresholds,
        streams=RELAY_STREAMS,
        window_s=wall,
        events=events,
        events_per_s=events / wall,
        streams_done=done,
        errors=at_end.errors - at_start.errors,
        router_cores=cpu / wall,
        router_cpu_us_per_event=cpu / events * 1e6 if events else None,
        machine_busy_cores=busy,
        rss_mib_end=procs.proc_sample(pid, "end", 0.0, 0).rss_mib,
        gc=gc_delta(gc_before, gc_after, wall),
    )
