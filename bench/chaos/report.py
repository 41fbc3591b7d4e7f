"""The chaos benchmark's report: one markdown table row per attack, the checks, and the files."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.chaos.lab import PhaseResult, Result
from bench.harness.report import write_json, write_text

_MAX_LABELS = 6  # outcome labels shown in a cell; the JSON has them all


def render(result: Result) -> str:
    """The whole report as markdown: header, table, details, checks."""
    o = result.options
    lines = [
        f"command: `{result.command}`",
        "",
        f"Measured commit {result.commit}; {result.cpu_count} CPUs shared by the simulator, tailguard and the client; "
        f"wall time {result.wall_s:.0f} s. Normal traffic: {o['normal_rate']:g} req/s short chats (half streamed) in every "
        f"phase, {o['pre']:g} s before the attack and {o['post']:g} s after its fault ended; fault window {o['window']:g} s. "
        f"Interactive pool: engines a and b, 8 seats each, ~{result.capacity_req_per_s['interactive']:g} req/s; batch pool: "
        f"engine c, 16 seats, ~{result.capacity_req_per_s['batch']:g} req/s of 200-token answers; engine faults hit engine a. "
        "The engines require a key, which tailguard sends. Rows that need another config (keys, [cluster], the shipped "
        "timeouts, the gRPC gate as shipped) run on a tailguard restarted with it; issue 32's rows give their figures, and "
        "what they failed, in the details.",
        "",
        "| attack | requests | outcomes (all requests) | normal traffic failed | no terminal answer "
        "| seats / queue / engine seqs after | fds before → after | RSS MiB before → max → after | recovery s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(p) for p in result.phases]
    lines += [
        "",
        "| attack | counted by tailguard | ERROR lines in its log | sockets to engines before → after "
        "| client sockets in CLOSE-WAIT before → after | settle s | details |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_detail(p) for p in result.phases]
    lines += ["", "Checks: " + ("all held." if not result.checks else f"{len(result.checks)} failed:")]
    lines += [f"- {line}" for line in result.checks]
    if result.notes:
        lines += ["", "Notes:"] + [f"- {line}" for line in result.notes]
    return "\n".join(lines)


def _row(p: PhaseResult) -> str:
    failed = sum(p.normal_failed.values())
    normal = f"{failed} of {p.normal}" + (f" ({_labels(p.normal_failed, 2)})" if failed else "")
    after = " / ".join(_number(v) for v in (p.seats, p.queued, p.engine_busy))
    recovery = "not within the window" if p.recovery_s is None else f"{p.recovery_s:.2f}"
    if p.tailguard_exit is not None:
        recovery += f" (tailguard exited {p.tailguard_exit})"
    return (
        f"| {p.attack} | {p.requests:,} | {_labels(p.outcomes, _MAX_LABELS)} | {normal} | {p.no_terminal} | {after} "
        f"| {p.before.fds} → {p.after.fds} | {p.before.rss_mib:.0f} → {p.rss_max_mib:.0f} → {p.after.rss_mib:.0f} | {recovery} |"
    )


def _detail(p: PhaseResult) -> str:
    counted = "?" if p.counted_by_tailguard is None else f"{p.counted_by_tailguard:,} of {p.requests:,}"
    skip = {"attack_outcomes", "faults", "tailguard_log_tail", "no_terminal_samples"}
    details = "; ".join(f"{k}: {_short(v)}" for k, v in p.extra.items() if k not in skip)
    if p.stale_retries:
        details += f"{'; ' if details else ''}stale keep-alive retries: {p.stale_retries}"
    return (
        f"| {p.attack} | {counted} | {p.log_errors} | {p.before.engine_conns} → {p.after.engine_conns} "
        f"| {p.before.close_wait} → {p.after.close_wait} | {p.settle_s:.1f} | {details or '-'} |"
    )


def _labels(counts: dict[str, int], limit: int) -> str:
    items = list(counts.items())
    shown = ", ".join(f"{label} ×{count:,}" for label, count in items[:limit])
    rest = sum(count for _, count in items[limit:])
    return shown + (f", other ×{rest:,}" if rest else "")


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _short(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def write_outputs(result: Result, text: str, out: Path, name: str) -> list[Path]:
    """``NAME.json`` (everything) and ``NAME.md`` (the printed report) under ``out``."""
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    write_json(json_path, asdict(result))
    write_text(md_path, text)
    return [json_path, md_path]
