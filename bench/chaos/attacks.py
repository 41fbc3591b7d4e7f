"""The chaos benchmark's attacks: each bounded in count and time, each against a running lab.

An attack runs while normal traffic goes on beside it (``bench.chaos``
starts that), sends its own requests into ``phase.answers`` (group
``attack``), and marks when its fault began and ended, so recovery is timed
from the end. Engine faults hit engine ``a`` of the two in the interactive
pool; ``b`` stays healthy, so a router that routes around a sick engine
loses nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import trio

from bench.chaos.client import JSON_CONTENT, Answer, HttpPool, Reply, RequestSpec, judge, probe_bytes, send
from bench.chaos.flood_client import bucket_quantile, flood_calls
from bench.chaos.lab import Lab, Setup
from bench.harness.procs import free_ports, process_cpu_seconds, start_process, stop, wait_listening
from bench.harness.stats import percentile
from tailguard.sim.faults import wants_stream

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
NORMAL_MAX_TOKENS = 32  # with a short prompt: the interactive class
BATCH_MAX_TOKENS = 200  # over the interactive class's 128: the batch class


@dataclass
class Phase:
    """What one attack did: its requests' answers, when its fault was on, anything else worth keeping."""

    answers: list[Answer] = field(default_factory=list)
    fault_start: float | None = None
    fault_end: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def fault_on(self) -> None:
        self.fault_start = time.perf_counter()

    def fault_off(self) -> None:
        self.fault_end = time.perf_counter()


Run = Callable[[Lab, Phase], Awaitable[None]]


@dataclass(frozen=True)
class Attack:
    name: str
    description: str
    run: Run
    fresh: bool = False  # on a new tailguard process: no earlier attack's ejections carry over
    setup: Setup = Setup()  # tailguard's config in the phase (another than the one in force: a new process)
    start_fault: dict[str, Any] | None = None  # engine a's fault mode from before tailguard starts (a new process, not warmed up)
    normal: bool = True  # normal traffic beside the attack


def chat_body(n: int, *, stream: bool, max_tokens: int = NORMAL_MAX_TOKENS, content: str | None = None) -> bytes:
    text = content if content is not None else f"Name a colour, please ({n})."
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}).encode()


def normal_spec(n: int, headers: tuple[tuple[str, str], ...] = ()) -> RequestSpec:
    """The n-th request of normal traffic: a short chat, every other one streamed; ``headers`` added (a key)."""
    stream = n % 2 == 1
    return RequestSpec(CHAT_PATH, chat_body(n, stream=stream), stream=stream, headers=(*JSON_CONTENT, *headers))


async def open_loop(
    lab: Lab, phase: Phase, specs: Sequence[RequestSpec], rate: float, group: str = "attack", *, keep: bool = True, pool: HttpPool | None = None
) -> list[Reply]:
    """Send ``specs`` at ``rate`` a second (to ``pool``, else the lab's), each without waiting for the others.

    Returns when all are answered: their replies, in the order of ``specs``.
    """
    start = time.perf_counter()
    replies = [Reply(failure="not sent")] * len(specs)

    async def one(i: int, spec: RequestSpec) -> None:
        replies[i] = await send(pool or lab.pool, spec, group, lab.client_timeout, phase.answers, keep=keep)

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(specs):
            await trio.sleep_until(trio.current_time() + max(0.0, start + i / rate - time.perf_counter()))
            nursery.start_soon(one, i, spec)
    return replies


# -- engine faults -----------------------------------------------------------------------


def engine_fault(*faults: dict[str, Any]) -> Run:
    """Engine ``a`` in each fault mode in turn (the window shared out), then healthy again.

    A ``huge`` fault's size is the run's ``--huge-mib``.
    """

    async def run(lab: Lab, phase: Phase) -> None:
        sized = [{**f, "size": lab.options.huge_mib << 20} if f["mode"] == "huge" else f for f in faults]
        phase.extra["faults"] = sized
        phase.fault_on()
        for fault in sized:
            await lab.set_fault("a", fault)
            await trio.sleep(lab.options.window / len(faults))
        await lab.set_fault("a", {"mode": "none"})
        phase.fault_off()

    return run


# -- client attacks ------------------------------------------------------------------------


async def baseline(lab: Lab, phase: Phase) -> None:
    """Nothing but the normal traffic: what every other row is compared with."""
    phase.fault_on()
    await trio.sleep(lab.options.window)
    phase.fault_off()


async def lone_surrogates(lab: Lab, phase: Phase) -> None:
    """One request a second whose text holds a lone UTF-16 surrogate (vLLM drops the connection on it)."""
    count = int(lab.options.surrogate_s)
    specs = []
    for i in range(count):
        stream = i % 2 == 1
        if i % 4 < 2:
            body = b'{"messages": [{"role": "user", "content": "chaos \\ud866 here"}], "max_tokens": 16, "stream": %s}'
        else:
            body = b'{"prompt": "chaos \\udfff", "max_tokens": 16, "stream": %s}'
        path = CHAT_PATH if i % 4 < 2 else COMPLETIONS_PATH
        specs.append(RequestSpec(path, body % (b"true" if stream else b"false"), stream=stream))
    phase.fault_on()
    await open_loop(lab, phase, specs, rate=1.0)
    phase.fault_off()


def fuzz_bodies(count: int, seed: int) -> list[RequestSpec]:
    """Malformed bodies: huge numbers, deep nesting, wrong types, bad encodings, mutated bytes."""
    rng = random.Random(seed)
    digits = "9" * 5000
    valid = chat_body(0, stream=False)
    fixed: list[tuple[str, bytes]] = [
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + digits.encode() + b"}"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": -' + digits.encode() + b"}"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1' + digits.encode() + b".5}"),
        (COMPLETIONS_PATH, b'{"prompt": [' + digits.encode() + b'], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "x": ' + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}"),
        (CHAT_PATH, b"[" * 5000 + b"]" * 5000),
        (CHAT_PATH, b'{"messages": "hi", "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [1, 2], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": 5}], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": null, "content": "hi"}], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": "yes"}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "model": 5}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream_options": []}'),
        (CHAT_PATH, b'{"messages": [], "max_tokens": 8}'),
        (COMPLETIONS_PATH, b'{"prompt": {}, "max_tokens": 8}'),
        (COMPLETIONS_PATH, b'{"prompt": [true, false], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3\x28"}], "max_tokens": 8}'),
        (CHAT_PATH, b"\xef\xbb\xbf" + valid),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 8}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "max_tokens": 9}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "' + b"k" * 100_000 + b'": 1, "max_tokens": 8}'),
        (CHAT_PATH, b""),
        (CHAT_PATH, b"null"),
        (CHAT_PATH, b'"just a string"'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}'),
        (CHAT_PATH, b"{" * 3),
        (COMPLETIONS_PATH, b'{"prompt": "hi", "max_tokens": 8, "n": 100000000000000000000000}'),
    ]
    specs = []
    for i in range(count):
        if i < len(fixed) or rng.random() < 0.5:
            path, body = fixed[i % len(fixed)]
        else:  # a valid body with a few bytes changed at random
            mutated = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            path, body = CHAT_PATH, bytes(mutated)
        specs.append(RequestSpec(path, body, stream=wants_stream(body)))
    return specs


async def fuzz(lab: Lab, phase: Phase) -> None:
    specs = fuzz_bodies(lab.options.fuzz, lab.options.seed)
    phase.fault_on()
    await open_loop(lab, phase, specs, rate=lab.options.fuzz_rate)
    phase.fault_off()


# Control characters in x-request-id, written by hand (h11 refuses to send them).
PROBES: tuple[tuple[str, bytes], ...] = (
    ("bare LF", b"probe\nx-injected: 1"),  # a second header if anyone splits on it
    ("bare CR", b"probe\rx-injected: 1"),
    ("NUL", b"probe\x00nul"),
    ("ESC", b"probe\x1b[2Jescape"),
    ("DEL", b"probe\x7fdel"),
    ("VT", b"probe\x0bvtab"),
    ("obs-text", b"probe\xffobs-text"),  # not a control character: HTTP allows it, the router may refuse it
)


async def header_injection(lab: Lab, phase: Phase) -> None:
    """x-request-id values with control characters over a raw socket; the router must refuse them."""
    echoed = 0
    accepted: set[str] = set()
    body = chat_body(0, stream=False, max_tokens=8)
    phase.fault_on()
    for _ in range(lab.options.probe_rounds):
        for probe, value in PROBES:
            raw = probe_bytes(lab.tg_port, CHAT_PATH, body, "x-request-id", value)
            spec = RequestSpec(CHAT_PATH, body, raw=raw)
            start = time.perf_counter()
            reply = await lab.pool.request(spec, lab.client_timeout, keep=False)
            outcome, terminal, ok = judge(reply, False)
            if reply.status == 200:
                if reply.headers.get("x-request-id") == "probe":
                    outcome = "200 (the HTTP parser ended the header at the control character)"
                elif probe == "obs-text":
                    outcome = "200 (obs-text accepted)"
                else:
                    outcome = "200 (control characters accepted)"
                accepted.add(probe)
            if "x-injected" in reply.headers:
                echoed += 1
            phase.answers.append(Answer("attack", start, time.perf_counter() - start, outcome, terminal, False, reply.size))
    phase.fault_off()
    phase.extra["injected_header_in_response"] = echoed
    phase.extra["accepted_with_200"] = sorted(accepted)


async def cancel_storm(lab: Lab, phase: Phase) -> None:
    """Clients that leave mid-stream (or before the first byte): seats and engine work must come back."""
    rng = random.Random(lab.options.seed)
    count = lab.options.cancels

    async def leaver(i: int) -> None:
        batch = i % 2 == 1  # max_tokens 300: the batch class, ~2.5 s of tokens
        spec = RequestSpec(CHAT_PATH, chat_body(i, stream=True, max_tokens=300 if batch else 128), stream=True)
        delay = rng.uniform(0.0, 1.0)
        leave: list[Answer] = []
        start = time.perf_counter()
        with trio.move_on_after(delay) as scope:
            await send(lab.pool, spec, "cancel", lab.client_timeout, leave, keep=False)
        if scope.cancelled_caught:
            phase.answers.append(Answer("cancel", start, delay, "client left", True, False))
        else:
            phase.answers.extend(leave)

    phase.fault_on()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            await trio.sleep_until(trio.current_time() + max(0.0, start + i / lab.options.cancel_rate - time.perf_counter()))
            nursery.start_soon(leaver, i)
    phase.fault_off()


async def overload(lab: Lab, phase: Phase) -> None:
    """Ten times a pool's capacity (``--overload-pool``), open loop, for ``overload_s``."""
    pool = lab.options.overload_pool
    rate = 10 * lab.capacity[pool]
    count = int(rate * lab.options.overload_s)
    phase.extra["pool"] = pool
    phase.extra["offered_req_per_s"] = round(rate, 1)
    if pool == "interactive":
        specs = [normal_spec(i) for i in range(count)]
    else:
        specs = [RequestSpec(CHAT_PATH, chat_body(i, stream=i % 2 == 1, max_tokens=BATCH_MAX_TOKENS), stream=i % 2 == 1) for i in range(count)]
    phase.fault_on()
    await open_loop(lab, phase, specs, rate)
    phase.fault_off()
    attack = [a for a in phase.answers if a.group == "attack"]
    for label, prefix in (("429", "429"), ("503", "503")):
        times = sorted(a.elapsed * 1000 for a in attack if a.outcome.startswith(prefix))
        if times:
            phase.extra[f"{label}_ms_p50_p99"] = [round(percentile(times, 50), 1), round(percentile(times, 99), 1)]


async def reload_storm(lab: Lab, phase: Phase) -> None:
    """Rewrite the config (engine a's max_concurrency 8 <-> 9) and SIGHUP, many times, under traffic."""
    before = await lab.reload_counts()
    phase.fault_on()
    steady = lab.setup
    for i in range(lab.options.reloads):
        lab.write_config(replace(steady, a_cap=steady.a_cap + 1 if i % 2 == 0 else steady.a_cap))
        if lab.tailguard.returncode is not None:
            break
        os.kill(lab.tailguard.pid, signal.SIGHUP)
        await trio.sleep(lab.options.reload_interval)
    lab.write_config(steady)
    os.kill(lab.tailguard.pid, signal.SIGHUP)
    phase.fault_off()
    await trio.sleep(1.0)  # the last reloads apply
    after = await lab.reload_counts()
    phase.extra["reloads_sent"] = lab.options.reloads + 1
    phase.extra["reloads_counted"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("ok", "failed")}


# -- gRPC ------------------------------------------------------------------------------------


# The flood's deadline a call: the (32) client; grpc core cancels what it holds unseen at 30 s.
FLOOD_DEADLINE_S = 20.0


async def grpc_flood(lab: Lab, phase: Phase) -> None:
    """Rounds of many gRPC calls at once on one channel (one round per size in ``grpc_calls``), each with a deadline.

    For the flood the interactive pool's queue is raised (a reload) so that
    the gate can reach the shipped one (``server.grpc_max_calls``; with this
    lab's small pools it would stop at twice their room plus 64), and every
    round is far over it. Every call must end OK or be refused at once
    (RESOURCE_EXHAUSTED), none CANCELLED or left to its deadline, and each
    must carry tailguard's marks (its request id on a refusal, its
    server-timing on an answer): a call without them never reached a handler,
    so it has no access line and no metric. Served calls' wait inside grpc is
    what the client waited beyond tailguard's own total (server-timing).
    Beside the flood, normal HTTP traffic must never hear no_backend and
    tailguard's /health (polled) must never call an endpoint down: the
    engines stay healthy, only tailguard is busy. Each round reports
    tailguard's event-loop lag (its ``tailguard_event_loop_lag_seconds``
    histogram over the round), and is run first against the floor
    (``bench.chaos.grpc_floor``: a server that refuses every call at once, in
    its own process): "at once" is judged against what the same refusals
    take there, on the same machine.
    """
    deadline = FLOOD_DEADLINE_S
    rounds: dict[str, Any] = {}
    failures: list[str] = []
    floor_port = free_ports(1)[0]
    floor = await start_process(lab.nursery, [sys.executable, "-m", "bench.chaos.grpc_floor", "--port", str(floor_port)], None)
    try:  # the catalog runs this on a set-up whose pools let the gate reach the shipped grpc_max_calls
        await wait_listening(floor_port, floor, "the gRPC floor")
        phase.fault_on()
        for count in lab.options.grpc_calls:
            floor_cpu = sum(process_cpu_seconds(floor.pid))
            floor_results = await lab.aio.run(partial(flood_calls, f"127.0.0.1:{floor_port}", count, deadline, {}, NORMAL_MAX_TOKENS))
            floor_cpu = sum(process_cpu_seconds(floor.pid)) - floor_cpu
            floor_ms = sorted(call.elapsed * 1000 for call in floor_results if call.code.startswith("RESOURCE_EXHAUSTED"))
            await trio.sleep(0.5)  # the floor's last sockets close before tailguard's round
            summary, round_failures = await _grpc_round(lab, phase, count, deadline)
            summary["floor"] = {
                "refused": len(floor_ms),
                "refused_ms_p50_p99_max": _p50_p99_max(floor_ms),
                "cpu_ms_per_call": round(floor_cpu * 1000 / count, 3),
            }
            tailguard_ms = summary.get("refused_ms_p50_p99_max")
            if floor_ms and tailguard_ms:
                summary["refused_p99_vs_floor"] = round(tailguard_ms[1] / max(percentile(floor_ms, 99), 1e-3), 2)
                over = tailguard_ms[2] - REFUSED_VS_FLOOR * floor_ms[-1]
                if over > 0:
                    round_failures.append(
                        f"{count} calls: a refusal took {tailguard_ms[2]:.0f} ms, over {REFUSED_VS_FLOOR:g}x the floor's slowest "
                        f"({floor_ms[-1]:.0f} ms): queued somewhere, not refused at once"
                    )
            elif len(floor_ms) < count:
                round_failures.append(f"{count} calls: the floor refused only {len(floor_ms)}: no measure of 'at once'")
            rounds[str(count)] = summary
            failures.extend(round_failures)
    finally:
        await stop(floor)
    phase.fault_off()
    phase.extra["grpc_rounds"] = rounds
    if failures:
        phase.extra["check_failures"] = failures


# A refusal slower than this many times the floor's slowest was queued somewhere, not refused. Measured
# here: the cheapest refusal tailguard has (over its cap: no Trio hop, one access-log line) costs 0.49 ms
# of CPU a call to the floor's 0.33 (1.5x), and a round also carries its ~280 OK streams and the normal
# traffic; a refusal that waited for a timer (a queue timeout, grpc's 30 s) would be many times over.
REFUSED_VS_FLOOR = 2.5


def _p50_p99_max(sorted_ms: list[float]) -> list[float]:
    return [round(percentile(sorted_ms, 50), 1), round(percentile(sorted_ms, 99), 1), round(sorted_ms[-1], 1)] if sorted_ms else []


def _p50_p90_max(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [round(percentile(ordered, 50), 2), round(percentile(ordered, 90), 2), round(ordered[-1], 2)] if ordered else []


async def _grpc_round(lab: Lab, phase: Phase, count: int, deadline: float) -> tuple[dict[str, Any], list[str]]:
    """One round of ``count`` calls at once against tailguard: its summary, and what it failed."""
    failures: list[str] = []
    lag_before = await lab.loop_lag_buckets()
    cpu_before = sum(process_cpu_seconds(lab.tailguard.pid))
    downs: set[str] = set()
    started = time.perf_counter()
    async with trio.open_nursery() as watch:
        watch.start_soon(_watch_health, lab, downs)
        details: dict[str, str] = {}
        results = await lab.aio.run(partial(flood_calls, f"127.0.0.1:{lab.grpc_port}", count, deadline, details, NORMAL_MAX_TOKENS))
        watch.cancel_scope.cancel()
    ended = time.perf_counter()
    cpu = sum(process_cpu_seconds(lab.tailguard.pid)) - cpu_before
    lag_after = await lab.loop_lag_buckets()
    origin_shift = time.perf_counter() - time.monotonic()  # asyncio's clock -> perf_counter
    codes: dict[str, int] = {}
    unseen: dict[str, int] = {}
    refused_ms: list[float] = []
    by_reason: dict[str, list[float]] = {}
    for call in results:
        code, _, word = call.code.partition(" ")  # "RESOURCE_EXHAUSTED server_busy": the status, the table's code
        client_deadline = code == "DEADLINE_EXCEEDED" and call.elapsed >= deadline - 0.5
        outcome = call.code if code != "OK" or call.finished else "OK without finish_reason"
        if client_deadline:
            outcome = "no answer (client deadline)"
        terminal = code != "CANCELLED" and not client_deadline and (code != "OK" or call.finished)
        phase.answers.append(
            Answer("attack", call.start + origin_shift, call.elapsed, f"gRPC {call.kind} {outcome}", terminal, code == "OK" and call.finished)
        )
        codes[outcome] = codes.get(outcome, 0) + 1
        if not call.seen:
            unseen[outcome] = unseen.get(outcome, 0) + 1
        if code == "RESOURCE_EXHAUSTED":
            refused_ms.append(call.elapsed * 1000)
            by_reason.setdefault(word or "?", []).append(call.elapsed * 1000)
    no_backend = sum(1 for a in phase.answers if a.group == "normal" and "no_backend" in a.outcome and started <= a.sent_at <= ended)
    lag_p99 = bucket_quantile(lag_before, lag_after, 0.99)
    summary: dict[str, Any] = {
        "calls": count,
        "outcomes": dict(sorted(codes.items(), key=lambda kv: -kv[1])),
        "without_access_line": unseen,
        "served_wait_in_grpc_s_p50_p90_max": _p50_p90_max([call.wait for call in results if call.wait is not None]),
        "wall_s": round(ended - started, 1),
        "http_no_backend": no_backend,
        "endpoints_down": sorted(downs),
        "loop_lag_p99_s": lag_p99,
        "loop_lag_max_s": lag_after[2] if lag_after else None,
        "details": details,
        "cpu_ms_per_call": round(cpu * 1000 / count, 3),
    }
    if refused_ms:
        refused_ms.sort()
        summary["refused_ms_p50_p99_max"] = _p50_p99_max(refused_ms)
    summary["refused_by_reason_n_p99_ms"] = {k: [len(v), round(percentile(sorted(v), 99), 1)] for k, v in by_reason.items()}
    wrong = {k: v for k, v in codes.items() if not k.startswith(("OK", "RESOURCE_EXHAUSTED"))}
    if wrong:
        failures.append(f"{count} calls: {wrong} (each must be OK or RESOURCE_EXHAUSTED)")
    if unseen:
        failures.append(f"{count} calls: {sum(unseen.values())} never reached tailguard (no access line, no metric): {unseen}")
    if no_backend:
        failures.append(f"{count} calls: {no_backend} HTTP requests beside the flood got no_backend")
    if downs:
        failures.append(f"{count} calls: tailguard called healthy endpoints down: {', '.join(sorted(downs))}")
    return summary, failures


async def _watch_health(lab: Lab, downs: set[str]) -> None:
    """Poll tailguard's /health (4 a second) and note every endpoint it calls down or ejected."""
    pool = HttpPool(lab.tg_port)
    try:
        while True:
            reply = await pool.request(RequestSpec("/health", b"", method="GET", headers=()), 5.0, keep=True)
            if reply.status in (200, 503):
                try:
                    pools = json.loads(reply.body)["pools"]
                except (ValueError, KeyError, TypeError):
                    pools = {}
                for state in pools.values():
                    downs.update(f"{url} {s}" for url, s in state.get("endpoints", {}).items() if s in ("down", "ejected"))
            await trio.sleep(0.25)
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()


ATTACKS: tuple[Attack, ...] = (
    Attack("baseline", "normal traffic only (20 req/s short chats, half streamed)", baseline),
    Attack("lone surrogate", "1 req/s whose text holds a lone UTF-16 surrogate (the engine drops the connection)", lone_surrogates),
    Attack("fuzz", "malformed bodies: 5,000-digit numbers, 1,000-deep JSON, wrong types, non-UTF-8, mutated bytes", fuzz),
    Attack("header injection", "control characters in x-request-id over a raw socket", header_injection),
    Attack("engine kill", "engine a stops listening and drops its connections; then revived", engine_fault({"mode": "kill"}), fresh=True),
    Attack("engine hang", "engine a accepts and reads, never answers (health checks too)", engine_fault({"mode": "hang"}), fresh=True),
    Attack("half-dead", "engine a: /health 200, completions hang", engine_fault({"mode": "half_dead"}), fresh=True),
    Attack("5xx rate", "engine a answers half its completions 500 (vLLM's error body)", engine_fault({"mode": "error_rate", "p": 0.5}), fresh=True),
    Attack("garbage", "engine a answers 200 with a body that is neither JSON nor SSE", engine_fault({"mode": "garbage"}), fresh=True),
    Attack(
        "truncated",
        "engine a ends streams after 3 events without [DONE], then cuts them mid-body; plain bodies cut in half",
        engine_fault({"mode": "truncated", "events": 3}, {"mode": "truncated", "events": 3, "abrupt": True}),
        fresh=True,
    ),
    Attack("huge error body", "engine a answers 500 with a huge error body", engine_fault({"mode": "huge", "status": 500}), fresh=True),
    Attack("huge 200 body", "engine a answers 200 with a huge completion / one huge SSE event", engine_fault({"mode": "huge", "status": 200}), fresh=True),
    Attack("gzip garbage", "engine a answers 200, content-encoding gzip, bytes that are not gzip", engine_fault({"mode": "gzip_garbage"}), fresh=True),
    Attack("redirect", "engine a answers 302 with a Location", engine_fault({"mode": "redirect"}), fresh=True),
    Attack("cancel storm", "streaming clients (interactive and batch) that hang up after 0-1 s", cancel_storm),
    Attack("10x overload", "ten times a pool's capacity (batch by default), open loop, beside interactive traffic", overload),
    Attack("reload storm", "config rewritten (an endpoint's max_concurrency) + SIGHUP, many times, under traffic", reload_storm),
    Attack("gRPC flood", "many concurrent gRPC calls (3 ChatStream : 1 Chat), each with a deadline", grpc_flood),
)
