"""The tail benchmark's report: the markdown tables, the JSON and the plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.harness.open_loop import FAST_REJECTION_MS, ClassStats
from bench.harness.report import md_table, write_json, write_text
from bench.harness.stats import percentile
from bench.tail.checks import Versus, kind_stats, versus
from bench.tail.model import PROBE_S, SHORT_DEADLINE_S, Options, Probe, Result, SetupResult


def _prompts(result: Result) -> str:
    """What the prompts and the engines' cache were (results from before issue 22 repeated one body per shape)."""
    if result.prefix_caching is None:
        return "one body per request shape, engines without a prefix cache"
    return f"every prompt unique (a nonce first), ignore_eos, engines' prefix cache {'on' if result.prefix_caching else 'off'}"


def render(result: Result) -> str:
    """The markdown report: per load, latency, rejection, process and memory tables; then the targets."""
    fail_fast = "router default" if result.fail_fast_fraction is None else f"{result.fail_fast_fraction:g}"
    out = [
        f"Engines {result.engines} (split {result.split} for disaggregated), traffic {result.traffic}, "
        f"time scale {result.time_scale:g} ({result.times_are}); shared capacity {result.shared_capacity_req_s:.1f} req/s; "
        f"warm-up {result.warmup_s:g} s, window {result.window_s:g} s, drain <= {result.drain_s:g} s (real) per set-up; "
        f"pools' fail_fast_fraction {fail_fast}; load average at start {result.load_average.get('start')}, "
        f"at end {result.load_average.get('end')} ({result.cpu_count} cores); {_prompts(result)}.",
        "",
        f"Command: `{' '.join(result.command)}`",
        "",
        f"Mix {result.mix_name}"
        + (f" ({result.phase_s:g} real s of each phase: chat, then origin)" if result.phase_s else "")
        + f"; engines' max_num_seqs {result.seats or 'profile default'}; lending rule(s) {', '.join(result.lend_rules)}; "
        f"rebalance (GPU s) {result.rebalance}; set-ups at once: engines <= {result.max_engines or 'one set-up at a time'}.",
        *[f"Note: {note}" for note in result.notes],
        "",
    ]
    table = versus(result)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        runs = [r for r in result.runs if round(r.load, 2) == load]
        out += [f"### load {load:g}", "", *_latency_table(runs), ""]
        if work := _work_table(runs, table, result.time_scale):
            out += [*work, ""]
        if added := _added_table(runs, result.time_scale):
            out += [*added, ""]
        out += [*_rejection_table(runs), "", *_process_table(runs, result), ""]
        if any(r.timeline for r in runs):
            out += [*_memory_table(runs), ""]
    checks = [(c["check"], c["value"], c["target"], "-" if c["met"] is None else "PASS" if c["met"] else "MISS") for c in result.checks]
    out += ["### targets (reported, not tuned for)", "", *md_table(["check", "value", "target", "met"], checks)]
    return "\n".join(out) + "\n"


STARVED_LAG_GPU_MS = 25.0  # the client sent its requests this late (P99): the machine's CPU, not the policy, is measured


def _work_table(runs: Sequence[SetupResult], table: dict[tuple[str, float], Versus], scale: float) -> list[str]:
    """Issue 12's view of one load: each set-up against shared (long served) and short-only (short P99s).

    A run whose client sent its requests more than STARVED_LAG_GPU_MS late
    (P99) is marked: a busy machine, not the set-up, made its latencies.
    """
    rows = [(run, table.get((run.setup, round(run.load, 2)))) for run in runs]
    if not any(v is not None and not math.isnan(v.long) for _, v in rows):
        return []
    header = [
        "set-up", "long served tok/s (x shared)", "short E2E P99 ms (x ideal)", "short TTFT P99 ms (x ideal)", "short not ok / long failed",
        "lent max / borrowed", "moves", "engines max running / sent (cap)", "load avg at start, set-ups at once, round", "client lag P99, GPU ms",
    ]
    cells = []
    for run, v in rows:
        if v is None:
            continue
        short = kind_stats(run, "short")
        assert short is not None
        lent = f"{run.borrowed.get('lent_max', math.nan):.0f} / {run.borrowed.get('borrowed', math.nan):.0f}" if run.borrowed else "-"
        moves = sum(1 for _, m in run.moves if "joined" in m)
        watch = run.engines
        engines = (
            f"{max(watch.max_running.values(), default=0)} / {max(watch.max_sent.values(), default=0)} ({max(watch.caps.values(), default=0)})"
            if watch and watch.looks else "-"
        )
        lag = run.client_lag_p99_ms / scale
        cells.append([
            run.setup, f"{v.long_tok_s:,.0f} ({v.long:.2f})", f"{short.e2e_ms['p99']:,.0f} ({v.short_e2e:.2f})",
            f"{short.ttft_ms['p99']:.1f} ({v.short_ttft:.2f})", f"{v.short_not_ok} / {v.long_failed}", lent, moves, engines,
            f"{run.load_average[0] if run.load_average else '-'}, {run.concurrent}, {run.round}",
            f"{lag:.0f}{' (starved)' if lag > STARVED_LAG_GPU_MS else ''}",
        ])
    return md_table(header, cells)


def _latency_table(runs: Sequence[SetupResult]) -> list[str]:
    header = [
        "set-up", "class", "n", "TTFT P50/P95/P99 ms", "E2E P50/P95/P99 ms", "ITL P50/P99 ms", "ok/429/503/timeout/other/cut",
        "ok ones within deadline", "goodput tok/s",
    ]
    return md_table(header, (_latency_row(run, c) for run in runs for c in run.classes if c.n))


def _latency_row(run: SetupResult, c: ClassStats) -> list[object]:
    outcome = "/".join(str(c.outcomes.get(k, 0)) for k in ("ok", "429", "503", "timeout", "other", "cut"))
    on_time = "-" if c.ok_within_deadline is None else f"{c.ok_within_deadline:.3f}"
    return [run.setup, c.kind, c.n, _trio(c.ttft_ms), _trio(c.e2e_ms), _trio(c.itl_ms), outcome, on_time, f"{c.goodput_tok_s:,.0f}"]


def _rejection_table(runs: Sequence[SetupResult]) -> list[str]:
    """How fast each kind of rejection came back: real ms at the client and inside the router, and GPU ms."""
    rows = [
        (run, c, kind, r) for run in runs for c in run.classes for kind, r in c.rejections.items()
    ]
    if not rows:
        return ["No request was rejected."]
    header = [
        "set-up", "class", "rejection", "n", "client real ms P50/P99/max", "router real ms P50/P99/max", "GPU ms P50/P99",
        f"share < {FAST_REJECTION_MS:g} ms real",
    ]
    return md_table(header, (
        (run.setup, c.kind, kind, r.n, _trio(r.client_ms), _trio(r.router_ms), _trio(r.gpu_ms), f"{r.under_10ms:.3f}")
        for run, c, kind, r in rows
    ))


def _process_table(runs: Sequence[SetupResult], result: Result) -> list[str]:
    header = [
        "set-up", "capacity req/s", "own load", "wall s", "cores sim/router/client", "router's busiest 2 s, cores",
        "router loop waiting for a CPU, mean / max share", "client lag P99 ms", "access log lines joined",
    ]
    rows = []
    for run in runs:
        cores = f"{run.cores['simulator']:.2f}/{run.cores.get('tailguard', 0):.2f}/{run.cores['client']:.2f}"
        own = run.load * result.shared_capacity_req_s / run.capacity_req_s
        busiest = "-" if math.isnan(run.router_cores_max) else f"{run.router_cores_max:.2f}"
        joined = "-" if math.isnan(run.access_lines_joined) else f"{run.access_lines_joined:.3f}"
        waits = [p.cpu_wait for p in run.timeline]
        starved = f"{sum(waits) / len(waits):.2f} / {max(waits):.2f}" if waits else "-"
        rows.append([
            run.setup, f"{run.capacity_req_s:.1f}", f"{own:.2f}", f"{run.wall_s:.0f}", cores, busiest, starved, f"{run.client_lag_p99_ms:.1f}", joined
        ])
    return md_table(header, rows)


def _memory_table(runs: Sequence[SetupResult]) -> list[str]:
    """The router's RSS over the run (so 'flat' can be judged) beside its sockets and queue."""
    header = [
        "set-up", "router RSS MiB start / warm-up end / last arrival / end", "peak", "window slope MiB/min", "open fds max", "waiting max",
        "GET /health ms P50 / max (None = over 1 s)", "GC pauses: n / over 10 ms / total ms", f"samples (every {PROBE_S:g} s)",
    ]
    rows = []
    for run in runs:
        if not run.timeline:
            continue
        rss = run.router_rss_mib
        points = " / ".join(f"{rss[k]:.0f}" for k in ("start", "warmup_end", "window_end", "end"))
        waiting = max((p.waiting for p in run.timeline if p.waiting is not None), default=math.nan)
        answered = sorted(p.health_ms for p in run.timeline if p.health_ms is not None)
        late = sum(1 for p in run.timeline if p.health_ms is None)
        health = f"{percentile(answered, 50):.1f} / {answered[-1] if answered else math.nan:.0f}" + (f" ({late} over 1 s)" if late else "")
        rows.append([
            run.setup, points, f"{rss['max']:.0f}", f"{rss['window_slope_per_min']:+.2f}", max(p.fds for p in run.timeline), f"{waiting:.0f}",
            health, _gc_during(run.timeline), len(run.timeline),
        ])
    return md_table(header, rows)


def _short(run: SetupResult) -> ClassStats:
    return next(c for c in run.classes if c.kind == "short")


def _added_table(runs: Sequence[SetupResult], scale: float) -> list[str]:
    """Short TTFT in real ms, through tailguard and fed directly: what the router adds (empty unless both ran)."""
    by = {r.setup: _short(r) for r in runs}
    if not {"disaggregated", "split-direct"} <= set(by):
        return []
    routed, direct = by["disaggregated"].ttft_ms, by["split-direct"].ttft_ms
    keys = ("p50", "p95", "p99")
    rows = [[name, *(f"{q[k] * scale:.1f}" for k in keys)] for name, q in (("disaggregated (tailguard)", routed), ("split-direct (no router)", direct))]
    rows.append(["added by tailguard", *(f"{(routed[k] - direct[k]) * scale:+.1f}" for k in keys)])
    return md_table(["short TTFT, real ms", "P50", "P95", "P99"], rows)


def _gc_during(timeline: Sequence[Probe]) -> str:
    """The router's GC pauses between the first and the last look ("-" when /metrics never told)."""
    seen = [p.gc for p in timeline if p.gc is not None]
    if len(seen) < 2:
        return "-"
    (n0, slow0, s0), (n1, slow1, s1) = seen[0], seen[-1]
    return f"{n1 - n0:.0f} / {slow1 - slow0:.0f} / {(s1 - s0) * 1000:.0f}"


def _trio(q: dict[str, float]) -> str:
    return " / ".join("-" if math.isnan(v) else f"{v:,.0f}" if v >= 100 else f"{v:.1f}" for v in q.values())


def write_outputs(result: Result, options: Options, table: str) -> list[Path]:
    """JSON, markdown and the plots; returns their paths.

    matplotlib is imported here, when a run has something to plot: the test
    extra does not install it, and ``--help`` or the tests' imports of the
    driver must not need it.
    """
    from bench.tail.plot import plot_cdfs, plot_p99_vs_load, plot_shift, plot_timelines, plot_tradeoff

    paths = [options.out / f"{options.name}.json", options.out / f"{options.name}.md"]  # a name may hold dots
    payload = asdict(result)
    for run_json in payload["runs"]:
        for class_json in run_json["classes"]:
            class_json.pop("e2e_sorted_ms")
            class_json.pop("ttft_sorted_ms")
    write_json(paths[0], payload)
    write_text(paths[1], table)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        runs = [r for r in result.runs if round(r.load, 2) == load]
        curves = {r.setup: {c.kind: c.e2e_sorted_ms for c in r.classes} for r in runs}
        paths.append(options.out / f"{options.name}-cdf-load{load:g}.png")
        plot_cdfs(paths[-1], load, curves)
        if {"disaggregated", "split-direct"} <= set(curves):
            ttft = {r.setup: {"short": [v * result.time_scale for v in _short(r).ttft_sorted_ms]} for r in runs}
            paths.append(options.out / f"{options.name}-short-ttft-load{load:g}.png")
            plot_cdfs(paths[-1], load, ttft, "short TTFT, ms (real time)")
        timelines = {r.setup: [(p.t, p.rss_mib, p.waiting) for p in r.timeline] for r in runs if r.timeline}
        if timelines:
            paths.append(options.out / f"{options.name}-router-load{load:g}.png")
            plot_timelines(paths[-1], load, timelines, (options.warmup, options.warmup + options.seconds))
    series: dict[str, list[tuple[float, float]]] = {}
    for run in result.runs:
        series.setdefault(run.setup, []).append((run.load, _short(run).e2e_ms["p99"]))
    paths.append(options.out / f"{options.name}-short-p99-vs-load.png")
    plot_p99_vs_load(paths[-1], series, SHORT_DEADLINE_S * 1000)
    ratios = versus(result)
    for load in dict.fromkeys(round(r.load, 2) for r in result.runs):
        points = {
            run.setup: (v.long, v.short_e2e)
            for run in result.runs
            if round(run.load, 2) == load and run.kind != "short-only" and (v := ratios.get((run.setup, load))) and not math.isnan(v.long)
        }
        if len(points) > 1:
            paths.append(options.out / f"{options.name}-tradeoff-load{load:g}.png")
            plot_tradeoff(paths[-1], load, points, result.engines)
    shifting = [r for r in result.runs if r.series]
    if shifting:
        for load in dict.fromkeys(round(r.load, 2) for r in shifting):
            runs = [r for r in shifting if round(r.load, 2) == load]
            paths.append(options.out / f"{options.name}-shift-load{load:g}.png")
            plot_shift(
                paths[-1],
                load,
                {r.setup: r.series for r in runs},
                {r.setup: [(p.t / result.time_scale, p.assignment) for p in r.timeline if p.assignment] for r in runs},
                result.phase_s / result.time_scale if result.phase_s else None,
            )
    return paths
