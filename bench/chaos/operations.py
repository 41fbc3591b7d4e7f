"""Attacks from the operator's side and the engines' (issue 32): a reload that removes a pool, relayed engine messages, a black hole.

Each records in ``phase.extra`` the figures that say whether the defect is
there, and in ``phase.extra["check_failures"]`` what the row failed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import trio

from bench.chaos.attacks import CHAT_PATH, Phase, chat_body, open_loop
from bench.chaos.client import JSON_CONTENT, Answer, Reply, RequestSpec, send
from bench.chaos.figures import p50_p99_max_ms
from bench.chaos.lab import ENGINE_KEY, SEATS_PER_ENGINE, Lab

# -- a reload that removes a pool with a queue -------------------------------------------------------

INTERACTIVE_QUEUE_TIMEOUT_S = 3.0  # the lab's interactive class (bench.harness.config.classes_tables)
REMOVAL_BURST = 4 * SEATS_PER_ENGINE  # twice the interactive pool's seats: as many wait as run


async def reload_removes_pool(lab: Lab, phase: Phase) -> None:
    """Fill the interactive pool and its queue, then reload a config without that pool (its class goes to batch).

    The waiters must go where their class goes now, or fail at once: none may
    wait out its queue deadline in a queue nobody serves (before the fix:
    503 queue_timeout after the full 3 s). Then the lab's config comes back.
    """
    steady = lab.setup
    headers = (*JSON_CONTENT, *steady.normal_headers)
    burst = [RequestSpec(CHAT_PATH, chat_body(30_000 + i, stream=i % 2 == 1, max_tokens=100), stream=i % 2 == 1, headers=headers) for i in range(REMOVAL_BURST)]
    reloaded_at = 0.0
    waiting: float | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_loop, lab, phase, burst, 1000.0)
        await trio.sleep(0.3)  # seated and queued
        queues = await lab.scrape(lab.tg_port, ("tailguard_pool_queue_length",))
        waiting = None if queues is None else queues.get(("tailguard_pool_queue_length", "pool=interactive"))
        phase.fault_on()
        await lab.reload(replace(steady, interactive_pool=False))
        reloaded_at = time.perf_counter()
    await lab.reload(steady)
    phase.fault_off()
    ends: dict[str, list[float]] = {}
    for a in phase.answers:
        if a.group == "attack":
            ends.setdefault(a.outcome, []).append(a.sent_at + a.elapsed - reloaded_at)
    stranded = [a for a in phase.answers if a.group == "attack" and not a.ok and a.elapsed >= INTERACTIVE_QUEUE_TIMEOUT_S - 0.3]
    phase.extra["waiting_at_reload"] = waiting
    phase.extra["ended_after_reload_s_p50_max"] = {k: [len(v), round(sorted(v)[len(v) // 2], 2), round(max(v), 2)] for k, v in ends.items()}
    phase.extra["reloads"] = await lab.reload_counts()
    if stranded:
        phase.extra["check_failures"] = [
            f"{len(stranded)} requests waiting in the removed pool's queue failed after its full deadline ({Counter(a.outcome for a in stranded)})"
        ]


# -- relayed engine messages -------------------------------------------------------------------------

# (status, engines) in this order: a 400 is the caller's to read (engine a alone); a 500 or a 401 is retried on
# another endpoint, so both interactive engines give it, for the caller to hear of it (a 401 takes an engine out
# until a probe passes).
ECHOED = ((400, ("a",)), (500, ("a", "b")), (401, ("a", "b")))


async def relayed_messages(lab: Lab, phase: Phase) -> None:
    """The interactive engines answer 400 (a), then 500 and 401 (a and b), quoting the Authorization they got (tailguard's key).

    No answer a client gets (body or header) and no line of tailguard's log
    may hold the key; no answer may name an engine's address.
    """
    log_from = lab.tg_log.stat().st_size
    headers = (*JSON_CONTENT, *lab.setup.normal_headers)
    specs = [
        RequestSpec(CHAT_PATH, chat_body(40_000 + i, stream=i % 2 == 1, max_tokens=8), stream=i % 2 == 1, headers=headers)
        for i in range(int(10 * lab.options.window))
    ]
    replies: list[Reply] = []
    phase.fault_on()
    async with trio.open_nursery() as nursery:

        async def traffic() -> None:
            replies.extend(await open_loop(lab, phase, specs, 10.0))

        nursery.start_soon(traffic)
        for status, engines in ECHOED:
            for engine in lab.engines:
                await lab.set_fault(engine, {"mode": "echo_auth", "status": status} if engine in engines else {"mode": "none"})
            await trio.sleep(lab.options.window / len(ECHOED))
        for engine in lab.engines:
            await lab.set_fault(engine, {"mode": "none"})
    phase.fault_off()
    key = ENGINE_KEY.encode()
    addresses = [f"127.0.0.1:{port}".encode() for port in lab.engines.values()]
    holding_key = [r for r in replies if key in _seen(r)]
    naming_engine = [r for r in replies if any(address in _seen(r) for address in addresses)]
    with lab.tg_log.open("rb") as log:
        log.seek(log_from)
        key_in_log = sum(1 for line in log if key in line)
    phase.extra["errors_relayed"] = dict(Counter(str(r.status) for r in replies if r.status != 200))
    phase.extra["answers_holding_engine_key"] = _by_status(holding_key)
    phase.extra["answers_naming_an_engine_address"] = _by_status(naming_engine)
    phase.extra["log_lines_holding_engine_key"] = key_in_log
    failures = []
    if holding_key or key_in_log:
        failures.append(f"tailguard's engine key reached {len(holding_key)} answers and {key_in_log} log lines")
    if naming_engine:
        failures.append(f"{len(naming_engine)} answers named an engine's address")
    if failures:
        phase.extra["check_failures"] = failures


def _seen(reply: Reply) -> bytes:
    """What a client saw of an answer: its body and its header values."""
    return reply.body + "\n".join(reply.headers.values()).encode("latin-1", "replace")


def _by_status(replies: list[Reply]) -> dict[str, int]:
    return dict(Counter(str(r.status) for r in replies))


# -- a black hole, with the shipped timeouts ---------------------------------------------------------

BLACK_HOLE_STREAMS = 20
BLACK_HOLE_RATE = 4.0  # a second: the streams come over the first 5 s
HELD_S = 10.0  # a stream this long without its answer was sent to the black hole (the shipped first-byte timeout is 60 s)


async def black_hole(lab: Lab, phase: Phase) -> None:
    """Engine a accepts and never answers, from before tailguard starts (shipped timeouts and health checks); 20 streams.

    An endpoint must be unusable until its first probe passes, so none may be
    held: each is answered within 10 s. ``--quick`` waits 10 s for each (what
    is held longer is counted and left); the full run waits the shipped
    deadline out (120 s), to see how held streams end.
    """
    wait = lab.options.black_hole_wait_s
    headers = (*JSON_CONTENT, *lab.setup.normal_headers)
    start = time.perf_counter()
    phase.fault_on()

    async def stream(i: int) -> None:
        spec = RequestSpec(CHAT_PATH, chat_body(50_000 + i, stream=True), stream=True, headers=headers)
        sent = time.perf_counter()
        answers: list[Answer] = []
        with trio.move_on_after(wait) as scope:
            await send(lab.pool, spec, "attack", wait + 1.0, answers, keep=False)
        if scope.cancelled_caught:
            answers = [Answer("attack", sent, wait, f"no answer within {wait:g} s (client left)", True, False)]
        phase.answers.extend(answers)

    async with trio.open_nursery() as nursery:
        for i in range(BLACK_HOLE_STREAMS):
            await trio.sleep_until(trio.current_time() + max(0.0, start + i / BLACK_HOLE_RATE - time.perf_counter()))
            nursery.start_soon(stream, i)
    await lab.set_fault("a", {"mode": "none"})
    phase.fault_off()
    attack = [a for a in phase.answers if a.group == "attack"]
    held = [a for a in attack if a.elapsed >= HELD_S]
    phase.extra["held_over_10_s"] = len(held)
    phase.extra["held_ended"] = dict(Counter(a.outcome for a in held))
    phase.extra["held_ms_p50_p99_max"] = p50_p99_max_ms([a.elapsed for a in held])
    if held:
        phase.extra["check_failures"] = [f"{len(held)} of {len(attack)} streams went to the black-holed engine (held {HELD_S:g} s or more)"]
