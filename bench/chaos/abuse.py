"""Attacks a client can mount with well-formed requests (issue 32): n > 1, costly bodies, evading the gRPC shed.

Each records in ``phase.extra`` the figures that say whether the defect is
there, and in ``phase.extra["check_failures"]`` what the row failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
import trio

from bench.chaos.attacks import CHAT_PATH, NORMAL_MAX_TOKENS, Phase, open_loop
from bench.chaos.client import JSON_CONTENT, Answer, RequestSpec
from bench.chaos.figures import p50_p99_max_ms, usage_tokens
from bench.chaos.lab import BATCH_SEATS, ENGINE_SEQUENCES, SEATS_PER_ENGINE, SHIPPED_GRPC_GATE, Key, Lab, Setup
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

# -- n > 1 -------------------------------------------------------------------------------------------

WIDE = Key("wide", tokens_per_minute=5000)  # the key: n = 32 x 100 tokens served it 25,640 tokens in ~5 s
MANY_CHOICES = Setup(keys=(WIDE,))
WIDE_RATE = 10.0  # a second: n = 8 x 100 tokens, ~20 x its budget a minute
TOO_MANY = 32  # over limits.max_n (8 as shipped): a 400 naming n
_SCRAPE_EVERY_S = 0.05


def choices_body(i: int, n: int, *, stream: bool, max_tokens: int) -> bytes:
    request: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Name {n} colours, please ({i})."}],
        "max_tokens": max_tokens,
        "n": n,
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return json.dumps(request).encode()


async def many_choices(lab: Lab, phase: Phase) -> None:
    """Requests of n = 4..8 choices (streamed and whole, both classes), some of n = 32, and a budgeted key's n = 8 x 100 tokens.

    Every engine's ``vllm:num_requests_running`` (its sequences) is scraped
    every 50 ms: no engine may run more than its endpoint's max_concurrency
    (a and b also run the completion health probe, one sequence beyond it,
    as config.toml says). The budgeted key may be served at most its
    tokens_per_minute (the phase is shorter than a minute).
    """
    normal = (*JSON_CONTENT, *lab.setup.normal_headers)
    count = int(10 * lab.options.window)
    specs, wide = [], []
    for i in range(count):
        stream = i % 2 == 1
        n = TOO_MANY if i % 5 == 4 else 4 + (i // 5) % 5  # 4..8: n x max_tokens 64..256, either class
        specs.append(RequestSpec(CHAT_PATH, choices_body(i, n, stream=stream, max_tokens=16 if i % 3 else 32), stream=stream, headers=normal))
    for i in range(int(WIDE_RATE * lab.options.window)):
        stream = i % 2 == 1
        body = choices_body(10_000 + i, 8, stream=stream, max_tokens=100)
        wide.append(RequestSpec(CHAT_PATH, body, stream=stream, headers=(*JSON_CONTENT, WIDE.header)))
    caps = {"a": lab.setup.a_cap, "b": SEATS_PER_ENGINE, "c": BATCH_SEATS}
    probe = {"a": 1, "b": 1, "c": 0}  # the interactive pool's completion health probe
    peak = dict.fromkeys(caps, 0.0)
    phase.fault_on()
    async with trio.open_nursery() as watch:
        watch.start_soon(_watch_sequences, lab, peak)
        async with trio.open_nursery() as senders:
            replies: dict[str, list[Any]] = {}

            async def loop(name: str, batch: list[RequestSpec], rate: float) -> None:
                replies[name] = await open_loop(lab, phase, batch, rate)

            senders.start_soon(loop, "n", specs, 10.0)
            senders.start_soon(loop, "wide", wide, WIDE_RATE)
        await trio.sleep(0.5)  # the last sequences' end shows in a scrape
        watch.cancel_scope.cancel()
    phase.fault_off()
    too_many = [r for spec, r in zip(specs, replies["n"], strict=True) if b'"n": 32' in spec.body]
    refused_n = sum(1 for r in too_many if r.status == 400 and _error_param(r.body) == "n")
    served = sum(usage_tokens(r, spec.stream) for spec, r in zip(wide, replies["wide"], strict=True))
    budget = WIDE.tokens_per_minute or 0
    phase.extra["peak_sequences_vs_cap"] = {name: [int(peak[name]), caps[name]] for name in caps}
    phase.extra["n_32_refused_400_param_n"] = f"{refused_n} of {len(too_many)}"
    phase.extra["budgeted_key"] = {"tokens_per_minute": budget, "tokens_served": served, "outcomes": dict(Counter(_status(r) for r in replies["wide"]))}
    failures = [f"engine {name} ran {int(peak[name])} sequences at once, over its cap {caps[name]}" for name in caps if peak[name] > caps[name] + probe[name]]
    if refused_n < len(too_many):
        failures.append(f"{len(too_many) - refused_n} of {len(too_many)} requests of n = {TOO_MANY} were not refused 400 naming n")
    if served > budget:
        failures.append(f"key {WIDE.name} was served {served:,} tokens in {lab.options.window:g} s, over its {budget:,} a minute")
    if failures:
        phase.extra["check_failures"] = failures


async def _watch_sequences(lab: Lab, peak: dict[str, float]) -> None:
    while True:
        for name, port in lab.engines.items():
            page = await lab.scrape(port, ENGINE_SEQUENCES[:1])
            if page is not None:
                peak[name] = max(peak[name], sum(page.values()))
        await trio.sleep(_SCRAPE_EVERY_S)


def _error_param(body: bytes) -> object:
    try:
        return json.loads(body)["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _status(reply: Any) -> str:
    return str(reply.status) if reply.status is not None else str(reply.failure)


# -- costly bodies ---------------------------------------------------------------------------------

COSTLY_RATE = 5.0  # a second, as in the issue
COSTLY_PIECES = 100_000


def costly_bodies() -> tuple[bytes, bytes]:
    """~3 MB each, under max_body_bytes: 100,000 empty text parts in one message; 100,000 one-letter messages."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * COSTLY_PIECES}], "max_tokens": 16}
    messages = {"messages": [{"role": "user", "content": "a"}] * COSTLY_PIECES, "max_tokens": 16}
    return json.dumps(parts).encode(), json.dumps(messages).encode()


async def costly(lab: Lab, phase: Phase) -> None:
    """5 bodies a second that cost the router CPU to read, beside normal traffic; each must be a 400.

    The normal traffic's latency while they come is compared with its
    latency over as long a stretch just before, in the same phase.
    """
    span = 2 * lab.options.window
    bodies = costly_bodies()
    headers = (*JSON_CONTENT, *lab.setup.normal_headers)
    specs = [RequestSpec(CHAT_PATH, bodies[i % 2], headers=headers) for i in range(int(COSTLY_RATE * span))]
    quiet_start = time.perf_counter()
    await trio.sleep(span)
    phase.fault_on()
    await open_loop(lab, phase, specs, COSTLY_RATE, keep=False)
    phase.fault_off()
    start, end = phase.fault_start, phase.fault_end
    assert start is not None and end is not None
    normal = [a for a in phase.answers if a.group == "normal" and a.ok]
    quiet = [a.elapsed for a in normal if quiet_start <= a.sent_at < start]
    attacked = [a.elapsed for a in normal if start <= a.sent_at <= end]
    before, during = p50_p99_max_ms(quiet), p50_p99_max_ms(attacked)
    phase.extra["body_mb"] = [round(len(b) / 1e6, 2) for b in bodies]
    phase.extra["normal_ms_p50_p99_max_before_during"] = [before, during]
    if before and during:
        phase.extra["normal_p50_p99_ratio"] = [round(during[0] / before[0], 2), round(during[1] / before[1], 2)]
    attack = Counter(a.outcome for a in phase.answers if a.group == "attack")
    wrong = {label: n for label, n in attack.items() if not label.startswith("400")}
    if wrong:
        phase.extra["check_failures"] = [f"costly bodies answered {wrong}, not 400"]


# -- shed evasion -----------------------------------------------------------------------------------

SHED_SPREAD_S = 2.0  # each flood's calls are sent over this long
SHED_GAP_S = 2.0  # between the two floods: the shed's window (1 s) forgets the first


async def shed_evasion(lab: Lab, phase: Phase) -> None:
    """Two gRPC floods on one channel beyond what the pools hold: one ``authorization`` value, then a new value per call.

    Without [auth] the value names no caller; a shed that keys on it (before
    authentication) is evaded by minting values. Counted: calls refused at the
    door by the shed (RESOURCE_EXHAUSTED server_busy, "sheds ..."), by the
    gate ("... calls open"), and refused or served inside.
    """
    count = lab.options.shed_calls
    address = f"127.0.0.1:{lab.grpc_port}"
    floods: dict[str, Any] = {}
    phase.fault_on()
    for name, value in (("one value", lambda i: "Bearer chaos-shed"), ("a value per call", lambda i: f"Bearer chaos-shed-{i}")):
        results = await lab.aio.run(partial(_flood, address, count, count / SHED_SPREAD_S, lab.client_timeout, value))
        origin_shift = time.perf_counter() - time.monotonic()
        for label, sent, elapsed, terminal, ok in results:
            phase.answers.append(Answer("attack", sent + origin_shift, elapsed, f"gRPC {label}", terminal, ok))
        outcomes = Counter(label for label, *_ in results)
        floods[name] = {"shed": outcomes["RESOURCE_EXHAUSTED server_busy (shed)"], "outcomes": dict(outcomes.most_common())}
        await trio.sleep(SHED_GAP_S)
    phase.fault_off()
    phase.extra["floods"] = floods
    # Of the calls the gate let through (the shed sees only those): how the gate stood differs between the two floods.
    one, many = (_shed_share(floods[name]["outcomes"], count) for name in ("one value", "a value per call"))
    phase.extra["shed_of_calls_past_the_gate"] = {"one value": round(one, 3), "a value per call": round(many, 3)}
    if one >= 0.05 and many < one / 2:
        phase.extra["check_failures"] = [
            f"a new authorization value per call evades the shed: {many:.0%} of the calls past the gate shed against {one:.0%} with one value"
        ]


def _shed_share(outcomes: dict[str, int], count: int) -> float:
    """The share of a flood's calls the shed refused, among those the gate let through."""
    past_gate = count - outcomes.get("RESOURCE_EXHAUSTED server_busy (gate)", 0)
    return outcomes.get("RESOURCE_EXHAUSTED server_busy (shed)", 0) / past_gate if past_gate else 0.0


async def _flood(address: str, count: int, rate: float, deadline: float, value: Callable[[int], str]) -> list[tuple[str, float, float, bool, bool]]:
    """On the asyncio thread: ``count`` calls at ``rate`` on one channel (3 streams to 1 unary), call i with ``value(i)``.

    Each: (outcome label, sent at, elapsed, exactly one terminal answer, served).
    """
    channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.CompletionsStub(channel)
    request = pb.ChatRequest(messages=[pb.Message(role="user", content="Name a colour, please.")], options=pb.Options(max_tokens=NORMAL_MAX_TOKENS))

    async def one(i: int) -> tuple[str, float, float, bool, bool]:
        start = time.monotonic()
        metadata = (("authorization", value(i)),)
        finished = False
        try:
            if i % 4 == 3:
                finished = bool((await stub.Chat(request, timeout=deadline, metadata=metadata)).finish_reason)
            else:
                async for chunk in stub.ChatStream(request, timeout=deadline, metadata=metadata):
                    finished = finished or bool(chunk.finish_reason)
            label = "OK" if finished else "OK without finish_reason"
        except grpc.aio.AioRpcError as error:
            label = _refusal(error)
        elapsed = time.monotonic() - start
        late = label.startswith("DEADLINE_EXCEEDED") and elapsed >= deadline - 0.5
        return label, start, elapsed, not late and not label.startswith(("CANCELLED", "OK without")), label == "OK"

    start = time.monotonic()
    tasks = []
    try:
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(i)))
        return list(await asyncio.gather(*tasks))
    finally:
        await channel.close()


def _refusal(error: grpc.aio.AioRpcError) -> str:
    """A failed call's label: its status and tailguard's error code; for server_busy, whether the shed or the gate said so."""
    code = str(error.code().name)
    word = dict(error.trailing_metadata() or ()).get("x-tailguard-error-code")
    if not isinstance(word, str):
        return code
    if word == "server_busy":
        details = str(error.details())
        word += " (shed)" if "sheds" in details else " (gate)" if "calls open" in details else ""
    return f"{code} {word}"


# The gRPC flood and the shed evasion run with the gate as shipped: the batch pool's queue is deep enough that the
# gate's bound from the pools' room (twice what they seat and queue, plus 64: docs/grpc.md) is not the lower one.
SHIPPED_GATE = Setup(batch_queue=SHIPPED_GRPC_GATE)
