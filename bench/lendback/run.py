"""``python -m bench lendback``: where borrowed seats go, measured in virtual time (bench/results/tail/lend-back-stall.md).

tail-issue12.md ("What the router would need to do better", item 1): a short
request seated on a batch engine by lend-back is stalled by that engine's
long prefills. This replays ``bench tail``'s scenarios (32 seats an engine,
the shipped lending rules: interactive lends prompts <= 512 tokens keeping 4
seats, batch lends any idle seat back) through the real router core in
virtual time (``tailguard.server.advise.replay``; set-ups from ``tailguard
advise``'s candidates), so the endpoint choice in ``router/fleet/pool.py`` is what
varies: run it once per version of that code (``run --label NAME``), then
``report`` the runs side by side. Nothing here registers with ``bench``.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.cli import driver_parser
from bench.harness.report import write_json
from tailguard.router.config import LendConfig, load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.candidates import Candidate, candidate_setup, shared_setup
from tailguard.server.advise.fleet import Fleet, fleet_from
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.replay.mix import MIXES, pooled_capacity
from tailguard.server.advise.replay.point import Point, run_point
from tailguard.server.advise.replay.setups import Setup
from tailguard.server.advise.replay.trace import generated
from tailguard.sim.params import PROFILES

SEATS = 32  # bench tail --seats 32: every engine's max_num_seqs and its endpoint cap
PROFILE = {"latency": f"latency@{SEATS}", "throughput": f"throughput@{SEATS}"}
LEND = LendConfig(("batch",), reserve=4, max_prompt_tokens=512)  # bench tail's DEFAULT_LEND, the shipped rule
LEND_BACK = LendConfig(("interactive",))
WARMUP = 30.0  # GPU s: a long request lives ~10
TAIL = 60.0  # GPU s of unmeasured traffic after the window, so its last requests finish under load
OUT = Path("bench/results/tail")


@dataclass(frozen=True)
class Scenario:
    mix: str
    engines: int
    interactive: int
    load: float

    @property
    def name(self) -> str:
        return f"{self.mix} {self.engines}e {self.interactive}:{self.engines - self.interactive} @{self.load:g}"


SCENARIOS = (
    Scenario("origin", 4, 1, 0.8),
    Scenario("origin", 4, 1, 0.9),
    Scenario("origin", 4, 2, 0.8),
    Scenario("origin", 4, 2, 0.9),
    Scenario("origin", 2, 1, 0.9),
    Scenario("chat", 4, 1, 0.8),
    Scenario("chat", 4, 2, 0.8),
)


def register_profiles() -> None:
    """32-seat engines, as ``bench tail --seats 32`` runs them (the fleet names engines by profile)."""
    for profile, name in PROFILE.items():
        PROFILES.setdefault(name, PROFILES[profile].replace(max_num_seqs=SEATS))


def fleet(engines: int) -> Fleet:
    """The shipped config's two pools over ``engines`` 32-seat engines."""
    base = fleet_from(load_config(SHIPPED_CONFIG), engines)
    return dataclasses.replace(
        base,
        interactive=dataclasses.replace(base.interactive, profile=PROFILE["latency"], seats=SEATS, queue=256),
        batch=dataclasses.replace(base.batch, profile=PROFILE["throughput"], seats=SEATS, queue=512),
    )


def arrivals(scenario: Scenario, seconds: float, seed: int) -> tuple[float, tuple[Arrival, ...]]:
    """bench tail's schedule: the mix at ``load`` of round robin's modelled capacity; measured inside the window."""
    shapes = MIXES[scenario.mix]()
    rate = scenario.load * pooled_capacity(scenario.engines, PROFILES[PROFILE["throughput"]], [s[1:] for s in shapes])
    rows = generated(rate, WARMUP, seconds + TAIL, seed, None, shapes)
    return rate, tuple(
        Arrival(i, a.at, a.kind, WARMUP <= a.at < WARMUP + seconds, a.prompt, a.max_tokens) for i, a in enumerate(rows)
    )


def setups(scenario: Scenario) -> list[tuple[str, Setup]]:
    f = fleet(scenario.engines)
    split = (scenario.interactive, scenario.engines - scenario.interactive)
    return [
        ("shared", shared_setup(f)),
        ("short-only", dataclasses.replace(shared_setup(f, "short-only"), kinds=("short",))),
        ("static", candidate_setup(f, Candidate(*split, "static"))),
        ("lend", candidate_setup(f, Candidate(*split, "lend", LEND, LEND_BACK))),
    ]


Job = tuple[Scenario, str, Setup, int, float]


def run_job(job: Job) -> dict[str, object]:
    scenario, kind, setup, seed, seconds = job
    register_profiles()
    rate, schedule = arrivals(scenario, seconds, seed)
    result = run_point(Point(setup, scenario.load, rate, WARMUP, seconds, seed, schedule))
    row: dict[str, object] = {"scenario": scenario.name, "setup": kind, "seed": seed, "cpu_s": result.cpu_s}
    for stats in result.classes:
        row[stats.kind] = {
            "n": stats.n,
            "failed": stats.n - stats.ok,
            "e2e_p99": stats.e2e_p99_ms,
            "ttft_p99": stats.ttft_p99_ms,
            "goodput": stats.goodput_rps,
        }
    return row


def run(label: str, seconds: float, seeds: Sequence[int], jobs: int, baselines: bool) -> Path:
    register_profiles()
    work: list[Job] = [
        (scenario, kind, setup, seed, seconds)
        for scenario in SCENARIOS
        for kind, setup in setups(scenario)
        if baselines or kind == "lend"
        for seed in seeds
    ]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        rows = []
        for row in pool.imap_unordered(run_job, work, chunksize=1):
            rows.append(row)
            print(f"{len(rows)}/{len(work)} {row['scenario']} {row['setup']} seed {row['seed']} ({row['cpu_s']:.0f} s CPU)", file=sys.stderr)
    path = OUT / f"lend-back-stall-{label}.json"
    write_json(path, {"label": label, "seconds": seconds, "seeds": list(seeds), "rows": rows})
    return path


def _get(rows: list[dict[str, object]], scenario: str, setup: str, seed: int) -> dict[str, dict[str, float]]:
    found = [r for r in rows if r["scenario"] == scenario and r["setup"] == setup and r["seed"] == seed]
    assert len(found) == 1, (scenario, setup, seed, len(found))
    return found[0]  # type: ignore[return-value]


def report(baseline_path: Path, labelled: Sequence[Path]) -> str:
    """Per scenario and seed: long goodput x round robin / short E2E P99 x ideal / short TTFT P99 x ideal / long E2E P99 x round robin."""
    base = json.loads(baseline_path.read_text())
    runs = [json.loads(p.read_text()) for p in labelled]
    head = ["static"] + [f"lend, {r['label']}" for r in runs]
    lines = [
        f"{base['seconds']:g} GPU s window per point after {WARMUP:g} s warm-up; cells: long goodput x round robin / "
        "short E2E P99 x ideal / short TTFT P99 x ideal / long E2E P99 x round robin (short failures, if any)",
        "",
        "| scenario | seed | " + " | ".join(head) + " |",
        "|---|---|" + "---|" * len(head),
    ]
    for scenario in SCENARIOS:
        for seed in base["seeds"]:
            shared = _get(base["rows"], scenario.name, "shared", seed)
            ideal = _get(base["rows"], scenario.name, "short-only", seed)

            def cell(row: dict[str, dict[str, float]]) -> str:
                long, short = row["long"], row["short"]
                text = (
                    f"{long['goodput'] / shared['long']['goodput']:.2f} / {short['e2e_p99'] / ideal['short']['e2e_p99']:.2f}"
                    f" / {short['ttft_p99'] / ideal['short']['ttft_p99']:.2f} / {long['e2e_p99'] / shared['long']['e2e_p99']:.2f}"
                )
                return text + (f" ({short['failed']:.0f} failed)" if short["failed"] else "")

            cells = [cell(_get(base["rows"], scenario.name, "static", seed))]
            cells += [cell(_get(r["rows"], scenario.name, "lend", seed)) for r in runs]
            lines.append(f"| {scenario.name} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = driver_parser(__name__, __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="every scenario with the router code as it is now; writes lend-back-stall-LABEL.json")
    one.add_argument("--label", required=True)
    one.add_argument("--seconds", type=float, default=600.0, help="GPU s measured per point (default %(default)g)")
    one.add_argument("--seeds", default="1,2")
    one.add_argument("--jobs", type=int, default=2)
    one.add_argument("--no-baselines", action="store_true", help="only the lend set-ups (static and the baselines do not lend)")
    both = sub.add_parser("report", help="markdown: the first file's baselines and static split, every file's lend")
    both.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        seeds = [int(s) for s in args.seeds.split(",")]
        print(run(args.label, args.seconds, seeds, args.jobs, not args.no_baselines))
    else:
        print(report(args.files[0], args.files), end="")
    return 0

