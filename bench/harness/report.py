"""Writing results: JSON files, and the code version a result was measured on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.harness.procs import PROJECT_ROOT


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
