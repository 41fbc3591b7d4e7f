"""One workload against one set-up: open-loop requests on time, conversations as closed loops; every request's fate.

Open-loop requests go through the harness's ``play`` (one keep-alive pool,
token-timed). A conversation sends a turn, reads the answer's text off the
stream, waits its think time, and sends the history with that answer and
the next turn: what a chat client does. Everything is bounded: no request
is sent after the schedule's end, and the whole run stops ``drain`` real
seconds after it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from bench.harness.client import CHAT_PATH, http_request
from bench.harness.open_loop import Sample, TokenClient, TokenPool, play, send_one
from bench.prefix.model import Conversation, Request, Workload, body
from tailguard.server.advise.replay.trace import Arrival
from tailguard.sim.tokens import count_chat_tokens

RAW_SHORT_THRESHOLD = 500  # the shipped interactive class's max_prompt_tokens: a longer prompt is batch by raw length


class TextClient(TokenClient):
    """A TokenClient that keeps the response body, so a conversation can resend the answer it received."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.parts: list[bytes] = []

    def piece(self, piece: bytes) -> None:
        self.parts.append(piece)

    def answer(self) -> str:
        """The streamed answer's text: every ``delta.content`` of the SSE events, in order."""
        text: list[str] = []
        for line in b"".join(self.parts).split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if isinstance(content, str):
                        text.append(content)
        return "".join(text)


class TextPool(TokenPool):
    """A conversation's connections: a fresh TextClient a turn (think time outlasts a server's idle timeout), the last one kept to read."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.last: TextClient | None = None

    def take(self) -> TextClient:
        self.last = TextClient(self.port)
        self._all.append(self.last)
        return self.last


@dataclass
class Turned:
    """A conversation turn's sample and its prompt's raw token count (all of it, cached or not)."""

    sample: Sample
    prompt_tokens: int


def with_header(request: bytes, name: str, value: str) -> bytes:
    """``request`` with one more header after its request line."""
    return request.replace(b"\r\n", f"\r\n{name}: {value}".encode() + b"\r\n", 1)


def request_bytes(port: int, request: Request, pin_header: str | None) -> bytes:
    """The request's HTTP bytes for ``port``, with its key in ``pin_header`` when the set-up pins by a header."""
    raw = http_request(port, CHAT_PATH, body(request.messages, request.max_tokens))
    return with_header(raw, pin_header, request.key) if pin_header else raw


async def open_loop(workload: Workload, port: int, scale: float, drain: float, pin_header: str | None, label: str) -> list[Sample]:
    """The workload's requests, each on time (GPU s x ``scale``), measured after the warm-up."""
    if not workload.requests:
        return []
    arrivals = [Arrival(r.at * scale, r.kind, r.prompt_tokens, r.max_tokens, measured=r.at >= workload.warmup_s) for r in workload.requests]
    pool = TokenPool(port)
    try:
        samples, _ = await play(
            {"short": [pool], "long": [pool]},
            lambda p, number, _: request_bytes(p, workload.requests[number], pin_header),
            arrivals,
            drain,
            label,
            progress=False,
        )
    finally:
        await pool.aclose()
    return samples


async def conversations(
    chats: Sequence[Conversation], port: int, scale: float, window: tuple[float, float], drain: float, pin_header: str | None
) -> list[Turned]:
    """Every conversation from its start time; a turn is measured when sent within ``window`` (GPU s), none is sent after its end."""
    turned: list[Turned] = []
    origin = time.perf_counter()
    end = window[1] * scale
    with trio.move_on_after(end + drain):
        async with trio.open_nursery() as nursery:
            for chat in chats:
                nursery.start_soon(_chat, chat, port, scale, origin, window, pin_header, turned)
    return turned


async def _chat(
    chat: Conversation, port: int, scale: float, origin: float, window: tuple[float, float], pin_header: str | None, into: list[Turned]
) -> None:
    """One conversation's turns, in order; it ends at its last turn, a failed one, or the window's end."""
    await trio.sleep_until(trio.current_time() + chat.at * scale - (time.perf_counter() - origin))
    history: tuple[tuple[str, str], ...] = (("system", chat.system),)
    pool = TextPool(port)
    try:
        for number, turn in enumerate(chat.turns):
            await trio.sleep(turn.think * scale)
            now = time.perf_counter() - origin
            if now >= window[1] * scale:
                return
            messages = (*history, ("user", turn.user))
            request = Request(now / scale, "short", messages, turn.max_tokens, chat.key)
            sample = Sample("short", window[0] * scale <= now, 0.0, request_id=f"{chat.key}-{number}", at=now)
            into.append(Turned(sample, count_chat_tokens([c for _, c in messages])))
            await send_one(pool, request_bytes(port, request, pin_header), sample)
            sample.sent -= origin
            answer = pool.last.answer() if pool.last is not None else ""
            if sample.outcome != "ok" or not answer:
                return
            history = (*messages, ("assistant", answer))
    finally:
        await pool.aclose()
