"""The gRPC overhead benchmark's verdict and report: the issue's targets judged, and the markdown tables."""

from __future__ import annotations

from collections.abc import Sequence

from bench.grpc_overhead.phases import STREAM_MAX_TOKENS, STREAMS
from bench.grpc_overhead.records import OpenStreams, Result
from bench.harness.closed_loop import RunResult, runs_table
from bench.harness.load import StreamRun
from bench.harness.report import Target, cores_cell, maybe, md_table, targets_table

# The issue's targets.
TARGET_CALLS_PER_S = 2_500
TARGET_CHUNKS_PER_S = 20_000
TARGET_OPEN_STREAMS = 10_000
TARGET_RSS_MIB = 1024


def issue_targets(unary: Sequence[RunResult], streaming: Sequence[StreamRun], held: OpenStreams | None, requested: int) -> list[Target]:
    """The issue's targets, judged on the best gRPC unary run, the gRPC streams and the held streams."""
    top = max((r for r in unary if r.target == "grpc"), key=lambda r: r.req_per_s)
    stream = next(s for s in streaming if s.target == "grpc")
    targets = [
        Target("unary calls/s (gRPC)", f">= {TARGET_CALLS_PER_S:,}", f"{top.req_per_s:,.0f} (c={top.concurrency})", top.req_per_s >= TARGET_CALLS_PER_S),
        Target("chunks/s relayed (200 streams)", f">= {TARGET_CHUNKS_PER_S:,}", f"{stream.chunks_per_s:,.0f}", stream.chunks_per_s >= TARGET_CHUNKS_PER_S),
    ]
    if held is not None:
        before, during = held.samples[0], held.samples[2]
        peak = max(s.peak_rss_mib for s in held.samples)
        added_threads = during.threads - before.threads
        targets += [
            Target("concurrent open streams", f">= {TARGET_OPEN_STREAMS:,}", f"{held.open_at_hold_end:,} of {requested:,}", held.open_at_hold_end >= TARGET_OPEN_STREAMS),
            Target("tailguard RSS while holding", f"< {TARGET_RSS_MIB:,} MiB", f"{during.rss_mib:,.0f} MiB (peak {peak:,.0f})", peak < TARGET_RSS_MIB),
            Target(
                "no thread per stream",
                "threads added << streams",
                f"{before.threads} -> {during.threads} threads for {during.open_streams:,} streams",
                added_threads < max(1, during.open_streams // 100),
            ),
        ]
    return targets


def render(result: Result) -> str:
    """The three phases' tables and the targets."""
    unary = runs_table(
        result.unary, ["path", "concurrency", "calls", "errors", "P50 ms", "P99 ms", "calls/s", "cores: sim / tailguard / client", "tailguard CPU ms/call"], ".2f"
    )
    streaming = md_table(
        ["path", "streams", "window s", "chunks/s", "streams done", "errors", "cores: sim / tailguard / client", "tailguard CPU µs/chunk"],
        (
            (s.target, s.streams, f"{s.window_s:.1f}", f"{s.chunks_per_s:,.0f}", f"{s.streams_done:,}", s.errors, cores_cell(s.cores),
             maybe(s.tailguard_cpu_us_per_chunk, ".1f"))
            for s in result.streaming
        ),
    )
    lines = [
        "Unary `Chat`, max_tokens 16 (interactive), instant engine", "", *unary, "",
        f"Streaming `ChatStream`, {STREAMS} concurrent streams, max_tokens {STREAM_MAX_TOKENS} (interactive), instant engine", "", *streaming,
    ]
    held = result.open_streams
    if held is not None:
        lines += [
            "",
            f"Open streams: {held.requested:,} `ChatStream` calls held at once, max_tokens {held.max_tokens} (batch), "
            f"{held.endpoints} slow engine endpoint(s) ({' '.join(held.slow_engine_args)})",
            "",
            *md_table(
                ["moment", "at s", "open streams", "tailguard RSS MiB", "peak RSS MiB", "threads", "fds"],
                ((p.moment, f"{p.at_s:.1f}", f"{p.open_streams:,}", f"{p.rss_mib:,.0f}", f"{p.peak_rss_mib:,.0f}", p.threads, f"{p.fds:,}") for p in held.samples),
            ),
        ]
        codes = ", ".join(f"{code} {n}" for code, n in sorted(held.error_codes.items())) or "none"
        hold = held.hold_cores
        lines += [
            "",
            "| started | routed | got first chunk | open at end of hold | failed (codes) | ended early | ramp s | tailguard CPU ms/stream opened "
            "| RSS KiB/stream | hold: chunks/s, cores sim / slow sim / tailguard / client | cancel s | settle s | threads / fds back | unary call after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {held.started:,} | {held.routed:,} | {held.first_chunk:,} | {held.open_at_hold_end:,} | {held.failed} ({codes}) | {held.ended_early} "
            f"| {held.ramp_s:.1f} ({held.stopped_because}) | {held.tailguard_cpu_ms_per_stream_opened:.2f} | {held.rss_kib_per_open_stream:.0f} "
            f"| {held.hold_chunks_per_s:,.0f}, {hold['simulator']:.2f} / {hold['slow simulator']:.2f} / {hold['tailguard']:.2f} / {hold['client']:.2f} "
            f"| {held.cancel_s:.1f} | {held.settle_s:.1f} | {_yes(held.threads_back_to_baseline)} / "
            f"{_yes(held.fds_back_to_baseline) if held.fds_back_to_baseline else f'no, {held.fds_left_above_baseline:,} left'} "
            f"| {_yes(held.unary_call_ok_after)} |",
            "",
            "Ramp (s: open): " + ", ".join(f"{t:g}: {n:,}" for t, n in held.ramp_progress),
        ]
    lines += ["", *targets_table(result.targets)]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
