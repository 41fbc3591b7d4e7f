"""The hold benchmark's markdown report: the held streams' footprint and waits, and GC pauses per threshold."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.hold.gc_pauses import GcPauses
from bench.hold.holding import HOLD_MAX_TOKENS
from bench.hold.records import SLOW_SIM, Result
from bench.hold.relay import RELAY_MAX_TOKENS, RELAY_STREAMS
from bench.hold.router import THRESHOLD_LOG, in_force


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "> 200" if math.isinf(value) else f"{value:g}"


def _gc_rows(label: str, rows: Sequence[GcPauses]) -> list[str]:
    return [
        f"| {label} | {g.generation} | {g.count:,} | {g.per_s:.2f} | {_ms(g.mean_ms if g.mean_ms is None else round(g.mean_ms, 2))} "
        f"| {_ms(g.p50_le_ms)} | {_ms(g.p99_le_ms)} | {_ms(g.max_le_ms)} | {g.paused_ms_per_s:.2f} |"
        for g in rows
    ]


def render(result: Result) -> str:
    lines = [f"Measured tailguard code: commit {result.code}.", ""]
    h = result.hold
    if h is not None:
        lines += [
            f"## {h.target:,} concurrent HTTP SSE streams held by one tailguard process (`serve --no-grpc`)",
            "",
        ]
        if h.capped_because:
            lines += [f"Asked for {h.requested:,}; held {h.target:,}: {h.capped_because}.", ""]
        lines += [
            f"Streaming chats (max_tokens {HOLD_MAX_TOKENS}, batch class) to {h.engines} simulated engines in another process, "
            f"a token per stream every {h.step_ms:g} ms; the client reads each socket every {h.read_pause_s:g} s. "
            f"GC thresholds in the router: {h.gc_thresholds}.",
            "",
            "| moment | open streams | RSS MiB | peak RSS (VmHWM) MiB | threads | fds |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {s.moment} | {s.open_streams:,} | {s.rss_mib:,.1f} | {s.peak_rss_mib:,.1f} | {s.threads} | {s.fds:,} |" for s in h.samples]
        lines += [
            "",
            f"Ramp: {h.first_event:,} of {h.target:,} opened in {h.ramp_s:.1f} s ({h.stopped_because}); {h.failed} failed "
            f"{h.failures or ''}, {h.ended_early} ended early; router CPU {h.router_cpu_ms_per_stream_opened:.2f} ms a stream opened; cores while opening: "
            f"{_cores(h.ramp_cores)}. "
            f"RSS {h.rss_kib_per_open_stream:.1f} KiB a held stream over idle. "
            f"Hold: {h.hold_s:.1f} s, {h.hold_events_per_s:,.0f} events/s relayed, cores: {_cores(h.hold_cores)} "
            f"({_ms(None if h.router_cpu_us_per_event is None else round(h.router_cpu_us_per_event, 1))} µs an event), "
            f"machine busy {h.hold_machine_busy_cores:.2f} cores. After closing: settled in {h.settle_s:.1f} s, "
            f"{h.fds_left_above_idle} fds above idle.",
            "",
        ]
        warnings = [line for line in h.router_log_tail.splitlines() if line.strip() and not line.startswith(THRESHOLD_LOG)]
        if warnings:
            lines += ["The router's log, last lines:", "", "```", *warnings[-6:], "```", ""]
        lines += ["| wait (ramp, hold and close) | n | P50 ms | P99 ms | max ms |", "|---|---|---|---|---|"]
        lines += [f"| {w.what} | {w.count:,} | {w.p50_ms:.1f} | {w.p99_ms:.1f} | {w.max_ms:.1f} |" for w in h.latencies]
        lines += ["", "GC pauses while the streams open (ramp) and while they are held and relay (hold):", ""]
        lines += _gc_header() + _gc_rows("ramp", h.gc_ramp) + _gc_rows("hold", h.gc)
        lines.append("")
    if result.relay:
        lines += [
            f"## GC thresholds under the SSE relay load ({RELAY_STREAMS} streaming chats, max_tokens {RELAY_MAX_TOKENS}, instant engine, restarted as they end)",
            "",
            "| thresholds in force | events/s | router cores | router CPU µs/event | errors | machine busy cores | RSS MiB at end |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result.relay:
            per_event = "-" if r.router_cpu_us_per_event is None else f"{r.router_cpu_us_per_event:.1f}"
            lines.append(
                f"| {in_force(r.gc_thresholds)} | {r.events_per_s:,.0f} | {r.router_cores:.2f} | {per_event} | {r.errors} | {r.machine_busy_cores:.2f} | {r.rss_mib_end:,.0f} |"
            )
        lines += ["", "GC pauses over each window:", ""] + _gc_header()
        for r in result.relay:
            lines += _gc_rows(in_force(r.gc_thresholds), r.gc)
        lines += ["", f"The router's own words on its thresholds, first relay run: {result.relay[0].gc_thresholds}.", ""]
    soft, hard = result.nofile_soft_hard
    lines.append(
        f"{result.cpu_count} CPUs shared by the simulators, tailguard and this client (and whatever else runs). Load average "
        f"(1/5/15 min) {'/'.join(f'{v:.2f}' for v in result.load_average_start)} at the start, "
        f"{'/'.join(f'{v:.2f}' for v in result.load_average_end)} at the end. RLIMIT_NOFILE soft/hard {soft:,}/{hard:,}. "
        f"GC pause percentiles and max are histogram bucket upper bounds (ms); the mean is exact. Wall time {result.wall_s:.0f} s."
    )
    return "\n".join(lines)


def _cores(cores: dict[str, float]) -> str:
    """Cores by process, the slow simulators summed."""
    summed = {name: value for name, value in cores.items() if not name.startswith(SLOW_SIM)}
    slow = [value for name, value in cores.items() if name.startswith(SLOW_SIM)]
    if slow:
        summed[f"{len(slow)} slow simulators"] = sum(slow)
    return ", ".join(f"{name} {value:.2f}" for name, value in summed.items())


def _gc_header() -> list[str]:
    return [
        "| run | generation | collections | per s | mean ms | P50 <= ms | P99 <= ms | max <= ms | paused ms per s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
