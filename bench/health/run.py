"""``python -m bench health``: what a half-dead engine (``/health`` fine, completions hung) costs under each health_check, in virtual time.

Two simulated engines (latency profile, ``--max-tokens`` tokens a request:
~1 s of decode) in one pool of two endpoints (``--seats`` each, least
loaded), behind the router core with its health checks running (2 s
interval, 1 s timeout: the shipped ones). Seeded Poisson arrivals of
unary (non-streaming) chat requests at ``--rate`` a second for
``--seconds``; from ``--fault-at`` engine ``b`` takes every completion and
never answers, while its ``/health`` still says 200. Per set-up, the same
arrivals: ``health_check`` "http", "completion" and "auto" (the default)
with the fault, and "auto" with both engines healthy throughout (what the
default costs when nothing is wrong). Counted: requests that paid a
deadline (no answer within ``--deadline`` s: the end-to-end timeout), the
latency of the answered ones, and the completion probes each engine got
(its health checks' work on the engine: one 1-token completion each).
Writes ``bench/results/health/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio
import trio.testing

from bench.harness.cli import add_out_arg, add_seed_arg, driver_parser
from bench.harness.report import LatencyMs, latency_ms, md_table, write_report
from bench.harness.toml import TomlTable, dumps
from tailguard.router import Router
from tailguard.router.admission import RouterRequest
from tailguard.router.backend import ConnectorTransport
from tailguard.router.config import Config, EndpointConfig, parse_config
from tailguard.router.errors import TailguardError
from tailguard.sim import PROFILES, Engine, SimApp
from tailguard.sim.canned import canned_transport
from tailguard.sim.memory import memory_connector

RESULTS = Path("bench/results/health")
MODEL = "sim-llama-3.1-8b"
URLS = {"a": "http://engine-a:8000", "b": "http://engine-b:8000"}
SETUPS = (("http", True), ("completion", True), ("auto", True), ("auto", False))  # (health_check, engine b fails)


@dataclass(frozen=True)
class Options:
    rate: float = 4.0
    seconds: float = 300.0
    fault_at: float = 60.0
    deadline: float = 120.0
    seats: int = 16
    max_tokens: int = 64
    seed: int = 0
    out: Path = RESULTS


@dataclass
class SetupResult:
    health_check: str
    fault: bool
    sent: int = 0
    answered: int = 0
    paid_deadline: int = 0  # no answer within the deadline
    errors: Counter[str] = field(default_factory=Counter)
    latency: LatencyMs | None = None
    probes: dict[str, int] = field(default_factory=dict)  # completion probes each engine got
    completions: dict[str, int] = field(default_factory=dict)  # requests each engine got (probes excluded)


def config_for(health_check: str, options: Options) -> Config:
    endpoints: list[TomlTable] = [{"url": url, "max_concurrency": options.seats} for url in URLS.values()]
    pool: TomlTable = {"models": [MODEL], "max_model_len": 32768, "placement": "least_loaded", "health_check": health_check, "endpoints": endpoints}
    document: TomlTable = {"timeouts": {"end_to_end_timeout": options.deadline}, "pools": {"main": pool}, "classes": {"main": {"pool": "main", "queue_timeout": 10.0}}}
    return parse_config(dumps(document))


async def run_setup(health_check: str, fault: bool, options: Options) -> SetupResult:
    result = SetupResult(health_check, fault)
    probes: Counter[str] = Counter()
    completions: Counter[str] = Counter()
    rng = random.Random(options.seed)
    async with trio.open_nursery() as nursery:
        engines = {name: Engine(PROFILES["latency"], name=url) for name, url in URLS.items()}
        for engine in engines.values():
            await nursery.start(engine.run)
        start = trio.current_time()

        def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
            name = next(n for n, u in URLS.items() if u == endpoint.url)
            inner = ConnectorTransport(memory_connector(SimApp(engines[name], model=MODEL).handle, nursery))

            async def handle(request: httpx.Request) -> httpx.Response:
                if request.method == "POST":
                    (probes if b'"ping"' in request.content else completions)[name] += 1
                    if fault and name == "b" and trio.current_time() - start >= options.fault_at:
                        await trio.sleep_forever()
                return await inner.handle_async_request(request)

            return canned_transport(handle)

        router = Router(config_for(health_check, options), transport_factory=transport_for, seed=options.seed)
        await router.check_health()
        await nursery.start(router.run)
        took: list[float] = []

        async def one(index: int) -> None:
            request = RouterRequest(
                kind="chat", request_id=f"r{index}", messages=[{"role": "user", "content": f"question {index}"}],
                max_tokens=options.max_tokens, stream=False,
            )  # fmt: skip
            began = trio.current_time()
            with trio.move_on_at(router.deadline_for(request)):
                try:
                    async with router.open(request) as completion:
                        await completion.read()
                    took.append(trio.current_time() - began)
                    return
                except TailguardError as error:
                    result.errors[type(error).__name__] += 1
                    return
            result.paid_deadline += 1

        async with trio.open_nursery() as senders:
            while trio.current_time() - start < options.seconds:
                senders.start_soon(one, result.sent)
                result.sent += 1
                await trio.sleep(rng.expovariate(options.rate))
        nursery.cancel_scope.cancel()
    await router.aclose()
    result.answered = len(took)
    result.latency = latency_ms(sorted(took))
    result.probes, result.completions = dict(probes), dict(completions)
    return result


async def measure(options: Options) -> list[SetupResult]:
    return [await run_setup(kind, fault, options) for kind, fault in SETUPS]


def render(results: Sequence[SetupResult], options: Options) -> str:
    minutes = options.seconds / 60
    header = ["health_check", "engine b", "sent", "answered", "paid the deadline", "errors", "P50 ms", "P99 ms", "max ms",
              "completion probes a / b a minute", "probes / requests on a"]  # fmt: skip
    rows = []
    for r in results:
        lat = r.latency or latency_ms([])
        share = r.probes.get("a", 0) / max(r.completions.get("a", 0), 1)
        rows.append([
            r.health_check, f"half-dead from {options.fault_at:g} s" if r.fault else "healthy", r.sent, r.answered, r.paid_deadline,
            ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "-",
            f"{lat['p50_ms']:.0f}", f"{lat['p99_ms']:.0f}", f"{lat['max_ms']:.0f}",
            f"{r.probes.get('a', 0) / minutes:.1f} / {r.probes.get('b', 0) / minutes:.1f}", f"{share:.4f}",
        ])  # fmt: skip
    title = (
        f"# A half-dead engine, per health_check (virtual time)\n\n{options.rate:g} unary requests/s of {options.max_tokens} tokens"
        f" for {options.seconds:g} s over 2 engines x {options.seats} seats; deadline {options.deadline:g} s; seed {options.seed}.\n"
    )
    return "\n".join([title, *md_table(header, rows)])


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add = parser.add_argument
    defaults = Options()
    add("--rate", type=float, default=defaults.rate, help="requests a second (default %(default)s)")
    add("--seconds", type=float, default=defaults.seconds, help="virtual seconds of arrivals (default %(default)s)")
    add("--fault-at", type=float, default=defaults.fault_at, help="when engine b goes half-dead, s (default %(default)s)")
    add("--deadline", type=float, default=defaults.deadline, help="timeouts.end_to_end_timeout, s (default %(default)s)")
    add("--seats", type=int, default=defaults.seats, help="each endpoint's max_concurrency (default %(default)s)")
    add("--max-tokens", type=int, default=defaults.max_tokens, help="each request's max_tokens (default %(default)s)")
    add_seed_arg(parser, defaults.seed, "the arrivals")
    add_out_arg(parser, RESULTS)
    add("--name", default="half-dead", help="base name of the outputs (default %(default)s)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    options = Options(args.rate, args.seconds, args.fault_at, args.deadline, args.seats, args.max_tokens, args.seed, args.out)
    results = trio.run(measure, options, clock=trio.testing.MockClock(autojump_threshold=0))
    report = render(results, options)
    print(report)
    payload = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}, "results": [asdict(r) for r in results]}
    write_report(args.out, args.name, payload, report)
    return 0 if all(math.isfinite(r.sent) for r in results) else 1
