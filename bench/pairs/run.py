"""``python -m bench pairs``: ``bench router_overhead`` against two commits' router, in alternating pairs.

A change to the request path is judged by what it costs per request, and
on a shared machine one run of each proves nothing: the runs alternate
(before, after, before, after, ...) so drift in the machine's other work
falls on both. The load generator is this tree's ``bench/`` for every run
(the same client, unique prompts) and this tree's simulator (the same
engine); only the router differs: each commit is checked out in a worktree
of its own (``git worktree add --detach``, kept for the next use) and its
``router/`` and ``server/`` put first on ``PYTHONPATH`` as
``tailguard.router`` and ``tailguard.server`` (the names the editable
install gives this tree's), so the tailguard process the benchmark starts
runs that commit's code.

Each run writes ``{out}/{before|after}{n}.json``; the table printed at the
end is router CPU per request and added P50 at each concurrency, per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.harness.cli import driver_parser
from bench.harness.procs import PROJECT_ROOT

ROUTER = {"router": "router", "server": "server"}  # from the commit measured (pyproject's package-dir)
# From this tree: the engine, and the client's traffic (request bodies from server/advise/replay/mix.py).
SHARED = {"sim": "bench/sim", "server/advise": "server/advise"}


def worktree(rev: str) -> Path:
    """A detached worktree of ``rev`` under the temporary directory, made once."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=PROJECT_ROOT, check=True, capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"tailguard-at-{sha}"
    if not (path / "router").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=PROJECT_ROOT, check=True, capture_output=True)
    return path


def link_tree(tree: Path, into: Path) -> Path:
    """A PYTHONPATH entry importing ``tree``'s router and server, and this tree's simulator and traffic, as tailguard's.

    Each package is a folder of links to ``tree``'s entries, so that a shared
    one inside it (server/advise) can be this tree's without touching ``tree``.
    """
    package = into / "tailguard"
    for name, source in ROUTER.items():
        (package / name).mkdir(parents=True)
        for entry in (tree / source).iterdir():
            (package / name / entry.name).symlink_to(entry)
    for name, source in SHARED.items():
        link = package / name
        if link.is_symlink():
            link.unlink()  # the commit's own copy
        link.symlink_to(PROJECT_ROOT / source)
    return into


def run_one(link: Path, out: Path, args: Sequence[str]) -> dict[str, object]:
    """One ``bench router_overhead`` with ``link`` first on PYTHONPATH; its JSON."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(link), os.environ.get("PYTHONPATH", "")]))}
    command = [sys.executable, "-m", "bench", "router_overhead", *args, "--json", str(out)]
    subprocess.run(command, cwd=PROJECT_ROOT, env=env, check=True)
    result: dict[str, object] = json.loads(out.read_text())
    return result


def cells(result: dict[str, object]) -> dict[int, tuple[float, float]]:
    """Per concurrency: (router CPU ms a request, added P50 ms)."""
    runs, overhead = result["runs"], result["overhead"]
    assert isinstance(runs, list) and isinstance(overhead, list)
    cpu = {r["concurrency"]: r["router_cpu_ms_per_request"] for r in runs if r["target"] == "tailguard"}
    return {o["concurrency"]: (cpu[o["concurrency"]], o["added_p50_ms"]) for o in overhead}


def table(pairs: Sequence[tuple[dict[str, object], dict[str, object]]]) -> str:
    """Markdown: a row per pair, before -> after for each concurrency's router CPU and added P50."""
    concurrencies = sorted(cells(pairs[0][0]))
    head = ["pair", *(f"router CPU ms/request c={c}, before -> after" for c in concurrencies), *(f"added P50 ms c={c}" for c in concurrencies)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for number, (before, after) in enumerate(pairs, 1):
        b, a = cells(before), cells(after)
        cpu = [f"{b[c][0]:.3f} -> {a[c][0]:.3f}" for c in concurrencies]
        p50 = [f"{b[c][1]:+.3f} -> {a[c][1]:+.3f}" for c in concurrencies]
        rows.append("| " + " | ".join([str(number), *cpu, *p50]) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--before", required=True, help="the commit before the change (any git revision)")
    parser.add_argument("--after", required=True, help="the commit with it")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs, before first (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="folder for beforeN.json / afterN.json")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: bench router_overhead's own options")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="tailguard-pairs-") as tmp:
        links = {side: link_tree(worktree(rev), Path(tmp) / side) for side, rev in (("before", args.before), ("after", args.after))}
        for number in range(1, args.pairs + 1):
            found = {side: run_one(links[side], args.out / f"{side}{number}.json", rest) for side in ("before", "after")}
            pairs.append((found["before"], found["after"]))
    print(table(pairs))
    return 0

