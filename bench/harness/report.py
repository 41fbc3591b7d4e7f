"""Writing results and saying what they were measured on: the one JSON writer, markdown tables, the commit and its edits.

Every driver writes through ``write_json`` / ``write_report`` (standard
JSON: NaN as null, paths as text) and stamps its result with
``code_version()`` or ``git_commit()``: the commit, and whether any shipped
code differs from it (every folder pyproject installs, and pyproject itself,
not only the router's), so a number from an edited simulator is never
stamped "as committed".
"""

from __future__ import annotations

import json
import math
import subprocess
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from bench.harness.procs import PROJECT_ROOT
from bench.harness.stats import percentile


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


def json_safe(value: Any) -> Any:
    """``value`` as standard JSON takes it, recursively: NaN as None, a path as its text."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, payload: object) -> None:
    """The one result writer: ``payload`` (``json_safe``) as indented JSON at ``path``, its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(payload), indent=2) + "\n")


def save_json(path: Path, payload: object) -> None:
    """``write_json``, and say where (a driver's last line)."""
    write_json(path, payload)
    print(f"wrote {path}")


def write_jsonl(path: Path, rows: Iterable[object]) -> None:
    """Rows (``json_safe``) as JSON lines at ``path``, its folder made: per-request records too many to indent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(json_safe(row)) + "\n" for row in rows))


def write_text(path: Path, text: str) -> None:
    """A report's markdown (or any text result) at ``path``, its folder made, ending in one newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def write_report(out: Path, stem: str, payload: object, report: str) -> None:
    """``out/STEM.json`` (the numbers) and ``out/STEM.md`` (the printed report), and say so."""
    write_json(out / f"{stem}.json", payload)
    write_text(out / f"{stem}.md", report)
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


def shipped_paths() -> list[str]:
    """What a wheel is built from, relative to the root: every folder pyproject maps a package to, and pyproject itself.

    Read from pyproject, so a folder that moves or joins the wheel is
    checked without a change here; the shipped config.toml is inside
    ``server/`` (a link to the root's, which is listed too).
    """
    with (PROJECT_ROOT / "pyproject.toml").open("rb") as file:
        folders = tomllib.load(file)["tool"]["setuptools"]["package-dir"].values()
    return sorted({*folders, "pyproject.toml", "config.toml"})


def _dirty() -> bool:
    """Whether any shipped code has uncommitted changes (what a result's numbers depend on)."""
    return bool(_git("status", "--porcelain", "--", *shipped_paths()))


def _edits() -> str:
    return "uncommitted changes in " + ", ".join(shipped_paths())


def git_commit() -> str:
    """HEAD of the tree being measured, short, marked when shipped code has uncommitted changes."""
    try:
        head, dirty = _git("rev-parse", "--short", "HEAD"), _dirty()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" + {_edits()}" if dirty else "")


def code_version() -> str:
    """The commit of the tailguard code measured (the tree the router starts from), and whether shipped code had edits beyond it."""
    try:
        commit, dirty = _git("rev-parse", "HEAD"), _dirty()
    except (OSError, subprocess.SubprocessError):
        return f"unknown (no git checkout at {PROJECT_ROOT})"
    state = f"with {_edits()}" if dirty else "shipped code as committed"
    return f"{commit} ({state}), from {PROJECT_ROOT}"


@dataclass
class RunRecord:
    """What a driver's result opens with, so that every number in it can be traced to its run: the command, the code, the parameters."""

    command: list[str]
    code: str  # code_version()
    parameters: dict[str, Any]
