"""The overhead benchmark's markdown report: tailguard beside vllm-router, each phase's table, targets, profile summaries."""

from __future__ import annotations

from bench.harness.report import cores_cell, maybe, md_table, targets_table
from bench.overhead.compare import ADDED_MS_FLOOR
from bench.overhead.records import (
    DIRECT,
    PACED_MAX_TOKENS,
    PACED_PROFILE,
    PACED_ROUTER_OF,
    ROUTER_OF,
    SATURATION_CONCURRENCY,
    Result,
    router_cores,
)


def render(result: Result) -> str:
    """The markdown report: tables, targets, profile summaries, how it was measured."""
    lines = [f"Measured tailguard code: commit {result.code}.", ""] + _render_versus_peer(result)
    lines += _open_loop_table(result) + _saturation_table(result) + _sse_table(result) + _paced_table(result)
    lines += ["", "## Targets (reported, not tuned for)", "", *targets_table(result.targets)]
    lines += _profiles(result)
    lines += ["", "Load generators: " + "; ".join(result.load_generators) + "."]
    lines.append(
        f"Engines in the '{result.engine_profile}' profile; {result.cpu_count} CPUs shared by the simulator, tailguard and the load "
        f"generators (and whatever else runs: 'machine busy cores' counts every process; the saturation and SSE rows' include their warm-ups). "
        f"'send lag' is how late the client started a request after its scheduled time (in every latency); percentiles are over the "
        f"requests done (dropped and cut-off ones are counted beside them). "
        f"Wall time {result.wall_s:.0f} s."
    )
    return "\n".join(lines)


def _open_loop_table(result: Result) -> list[str]:
    added = {(a.path, a.rate): a for a in result.added}
    header = ["path", "rate req/s", "arrivals", "done", "errors / dropped / cut off", "conns", "P50 ms", "P99 ms", "added P50 / P99 ms"]
    header += ["send lag P50 / P99 ms", "cores: sim / router / client", "machine busy cores", "router CPU µs/req"]
    rows = []
    for r in result.open_loop:
        a = added.get((r.path, r.rate))
        plus = f"{a.added_p50_ms:+.2f} / {a.added_p99_ms:+.2f}" if a else "-"
        rows.append(
            (r.path, f"{r.rate:g}", f"{r.arrivals:,}", f"{r.completed:,}", f"{r.errors} / {r.dropped} / {r.unfinished}", r.connections, f"{r.p50_ms:.2f}",
             f"{r.p99_ms:.2f}", plus, f"{r.lag_p50_ms:.2f} / {r.lag_p99_ms:.2f}", _cores(r.cores, r.path), f"{r.machine_busy_cores:.2f}",
             maybe(r.router_cpu_us_per_request, ",.0f"))
        )  # fmt: skip
    return [f"## Added latency, open loop (non-streaming chat, max_tokens {result.max_tokens}; {result.arrivals})", "", *md_table(header, rows)]


def _saturation_table(result: Result) -> list[str]:
    header = ["path", "requests", "errors", "req/s", "P50 ms", "P99 ms", "router cores", "req/s per router core", "router CPU µs/req"]
    header += ["cores: sim / router / client", "machine busy cores"]
    rows = []
    for c in result.saturation:
        tg = router_cores(c.cores, c.target)
        per_core = f"{c.req_per_s / tg:,.0f}" if c.target != DIRECT and tg > 0 else "-"
        cpu = maybe(c.router_cpu_ms_per_request * 1000 if c.router_cpu_ms_per_request is not None else None, ",.0f")
        rows.append(
            (c.target, f"{c.requests:,}", c.errors, f"{c.req_per_s:,.0f}", f"{c.p50_ms:.2f}", f"{c.p99_ms:.2f}", f"{tg:.2f}", per_core, cpu,
             _cores(c.cores, c.target), maybe(result.machine_busy_cores.get(c.target), ".2f"))
        )  # fmt: skip
    return ["", f"## Saturation, closed loop at concurrency {SATURATION_CONCURRENCY}", "", *md_table(header, rows)]


def _sse_table(result: Result) -> list[str]:
    header = ["path", "streams", "window s", "events/s", "streams done", "errors", "cores: sim / router / client", "machine busy cores", "router CPU µs/event"]
    rows = (
        (s.target, s.streams, f"{s.window_s:.1f}", f"{s.chunks_per_s:,.0f}", f"{s.streams_done:,}", s.errors, _cores(s.cores, s.target),
         maybe(result.machine_busy_cores.get(f"{s.target} {s.streams}"), ".2f"), maybe(s.tailguard_cpu_us_per_chunk, ".1f"))
        for s in result.streams
    )  # fmt: skip
    return ["", f"## SSE relay, streaming chat (max_tokens {result.stream_max_tokens}), streams restarted as they end", "", *md_table(header, rows)]


def _paced_table(result: Result) -> list[str]:
    if not result.paced:
        return []
    header = ["path", "window s", "events/s", "streams done", "errors", "cores: sim / router / client", "machine busy cores", "router CPU µs/event"]
    rows = (
        (s.target, f"{s.window_s:.1f}", f"{s.chunks_per_s:,.0f}", f"{s.streams_done:,}", s.errors, _cores(s.cores, s.target, PACED_ROUTER_OF),
         maybe(result.machine_busy_cores.get(f"{s.target} paced"), ".2f"), maybe(s.tailguard_cpu_us_per_chunk, ".1f"))
        for s in result.paced
    )  # fmt: skip
    return [
        "",
        f"## SSE relay at engine pace: the '{PACED_PROFILE}' engine in real time, {result.paced[0].streams} streams (max_tokens "
        f"{PACED_MAX_TOKENS}: the batch class), a vllm-router of its own",
        "",
        *md_table(header, rows),
        "",
        "The engine sets the pace, so events/s are the same on every path; what differs is what each event costs the router.",
    ]


def _profiles(result: Result) -> list[str]:
    lines: list[str] = []
    for name, p in result.profiles.items():
        others = ", ".join(f"{thread} {n}" for thread, n in p.other_thread_samples.items()) or "none"
        inclusive = [(f, s) for f, s in p.top_inclusive if s < 0.9][:12]
        lines += [
            "",
            f"## Router profile: {name} (py-spy, `{_rel(p.path)}`)",
            "",
            f"{p.samples:,} samples of the main thread (other threads, mostly blocked waits: {others}).",
            "Self time by component (the leaf frame's package): " + ", ".join(f"{c} {s:.0%}" for c, s in p.self_by_component[:8]) + ".",
            "Inclusive by component (anywhere on the stack): " + ", ".join(f"{c} {s:.0%}" for c, s in p.inclusive_by_component[:10]) + ".",
            "",
            *md_table(["top self frames", "share"], ((f"`{f}`", f"{s:.1%}") for f, s in p.top_self[:10])),
            "",
            *md_table(["top inclusive frames (below 90%)", "share"], ((f"`{f}`", f"{s:.1%}") for f, s in inclusive)),
        ]
    return lines


def _render_versus_peer(result: Result) -> list[str]:
    """The headline: tailguard's two APIs beside vllm-router, with ratios (tailguard / vllm-router)."""
    if not result.versus_peer:
        return []
    lines = [
        f"## tailguard beside vllm-router (same run, same engine, same load; peer: {result.peer})",
        "",
        "| measure | better | vllm-router | tailguard HTTP | tailguard gRPC | HTTP / vllm-router | gRPC / vllm-router |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in result.versus_peer:
        fmt = ",.0f" if abs(v.peer) >= 100 else ".2f"
        lines.append(
            f"| {v.measure} | {v.better} | {format(v.peer, fmt)} | {maybe(v.http, fmt)} | {maybe(v.grpc, fmt)} "
            f"| {maybe(v.http_ratio, '.2f')}{'x' if v.http_ratio is not None else ''} | {maybe(v.grpc_ratio, '.2f')}{'x' if v.grpc_ratio is not None else ''} |"
        )
    lines += [
        "",
        "Added latency is over the engine called directly at the same arrivals; a ratio is left out ('-') when the peer's value is not "
        f"above {ADDED_MS_FLOOR:g} ms. The peer serves HTTP only: the gRPC column is tailguard's gRPC API beside the peer's HTTP.",
        "",
    ]
    return lines


def _rel(path: str) -> str:
    return path.rsplit("/work/main/", 1)[-1]


def _cores(cores: dict[str, float], path: str, routers: dict[str, str] = ROUTER_OF) -> str:
    """Simulator / the path's router / client cores (no router on the direct path)."""
    return cores_cell(cores, routers.get(path))
