"""Writing results: JSON files, markdown tables, and the code version a result was measured on."""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from bench.harness.procs import PROJECT_ROOT
from tailguard.server.advise.replay.mix import percentile


class LatencyMs(TypedDict):
    """A run's latency summary, in ms: the fields of that name in every closed- and open-loop result."""

    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


def latency_ms(ordered: Sequence[float]) -> LatencyMs:
    """``LatencyMs`` of latencies in seconds, already sorted (NaN everywhere when there are none)."""
    n = len(ordered)
    return LatencyMs(
        p50_ms=percentile(ordered, 50) * 1000,
        p99_ms=percentile(ordered, 99) * 1000,
        mean_ms=sum(ordered) / n * 1000 if n else math.nan,
        max_ms=ordered[-1] * 1000 if n else math.nan,
    )


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def save_json(path: Path, payload: object) -> None:
    """``write_json``, and say where (a driver's last line)."""
    write_json(path, payload)
    print(f"wrote {path}")


def write_report(out: Path, stem: str, payload: object, report: str) -> None:
    """``out/STEM.json`` (the numbers) and ``out/STEM.md`` (the printed report), and say so."""
    write_json(out / f"{stem}.json", payload)
    (out / f"{stem}.md").write_text(report + "\n")
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")


def md_row(cells: Iterable[object]) -> str:
    """One markdown table line, ``| a | b |``: cells already formatted (``str()`` of each)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def md_table(header: Sequence[str], rows: Iterable[Iterable[object]] = ()) -> list[str]:
    """A markdown table's lines: the header, the ``|---|`` rule, one line a row (every report's tables, one format)."""
    return [md_row(header), "|" + "---|" * len(header), *map(md_row, rows)]


def maybe(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or ``-`` where nothing was measured."""
    return "-" if value is None else format(value, spec)


def cores_cell(cores: Mapping[str, float], router: str | None = "tailguard") -> str:
    """The cores of the simulator, the router under test and the client in one cell, ``sim / router / client`` (``-``: no router)."""
    return f"{cores['simulator']:.2f} / {maybe(cores[router] if router is not None else None, '.2f')} / {cores['client']:.2f}"


@dataclass
class Target:
    """A goal a report states beside what was measured (reported, not tuned for)."""

    name: str
    goal: str
    measured: str
    met: bool


def targets_table(targets: Iterable[Target]) -> list[str]:
    return md_table(["target", "goal", "measured", "verdict"], ((t.name, t.goal, t.measured, "PASS" if t.met else "MISS") for t in targets))


def _git(*args: str) -> str:
    """A git command's output in this checkout (raises OSError or SubprocessError without one)."""
    return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()


def _dirty() -> bool:
    """Whether router/ or server/ have uncommitted changes (what a result's numbers depend on)."""
    return bool(_git("status", "--porcelain", "--", "router", "server"))


def git_commit() -> str:
    """HEAD of the tree being measured, short, marked when router/ or server/ have uncommitted changes."""
    try:
        head, dirty = _git("rev-parse", "--short", "HEAD"), _dirty()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes in router/ or server/" if dirty else "")


def code_version() -> str:
    """The commit of the tailguard code measured (the tree the router starts from), and whether router/ or server/ had edits beyond it."""
    try:
        commit, dirty = _git("rev-parse", "HEAD"), _dirty()
    except (OSError, subprocess.SubprocessError):
        return f"unknown (no git checkout at {PROJECT_ROOT})"
    state = "with uncommitted changes in router/ or server/" if dirty else "router/ and server/ as committed"
    return f"{commit} ({state}), from {PROJECT_ROOT}"
