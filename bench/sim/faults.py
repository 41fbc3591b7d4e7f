"""Fault modes: what a sick vLLM does on the wire, switchable while the engine runs.

A router is judged by what it does when its backends misbehave, so the
simulator can misbehave on demand. One mode is on at a time (``none`` by
default, which changes nothing):

==============  ==============================================================
``kill``        stop listening and drop every connection; any later mode
                (``none``, or its alias ``revive``) listens again on the port
``hang``        accept, read the request, never answer (every route)
``half_dead``   ``/health`` answers 200; completions hang
``error_rate``  a share ``p`` of completions answer 500 with vLLM's error body
``garbage``     completions answer 200 with a body that is not JSON (not SSE)
``truncated``   a stream ends after ``events`` SSE events without ``[DONE]``
                (``abrupt``: the socket closes mid-body instead of ending the
                chunked body); a plain body is cut in half and the socket closed
``huge``        completions answer ``status`` (500: an error body; 200: a
                completion) of ``size`` bytes, written in 64 KiB pieces
``gzip_garbage`` 200 with ``content-encoding: gzip`` over bytes that are not gzip
``redirect``    302 with a ``Location`` header
``tokenizer_panic`` the tokenizer panics: the connection closes with no answer,
                for completions whose text holds a lone UTF-16 surrogate
                (``trigger=surrogate``, the default: what vLLM builds whose
                tokenizer crashes on them did) or for every completion
                (``trigger=any``); a healthy engine answers such text 400
``echo_auth``   completions answer ``status`` (400, 401 or 500; default 500)
                with vLLM's error body, whose message quotes the request's
                ``Authorization`` header (an engine or proxy that echoes what
                it was sent: a router must not relay its key to callers)
==============  ==============================================================

Faults touch the completion routes (``/v1/chat/completions``,
``/v1/completions``) unless the table says otherwise; ``/_sim/faults`` itself
always answers. ``GET /_sim/faults`` shows the current fault as JSON, ``POST``
sets one from a JSON object such as ``{"mode": "error_rate", "p": 0.3}``; a
process of several engines may also serve an admin port
(``python -m tailguard.sim --admin-port``) that reaches each engine by its port,
which is how a killed engine is revived. At start, ``python -m tailguard.sim
--fault error_rate:p=0.3`` sets it for every engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from .app import JSON_HEADERS, SSE_HEADERS, ApiError, BodyStream, DropConnection, SimApp, SimResponse, holds_lone_surrogate

log = logging.getLogger("bench.sim.faults")

ADMIN_PATH = "/_sim/faults"
COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MODES = (
    "none",
    "kill",
    "hang",
    "half_dead",
    "error_rate",
    "garbage",
    "truncated",
    "huge",
    "gzip_garbage",
    "redirect",
    "tokenizer_panic",
    "echo_auth",
)
PANIC_TRIGGERS = ("surrogate", "any")
_ALIASES = {"revive": "none"}
# Which parameters each mode reads; any other parameter given with the mode is refused.
_PARAMS: dict[str, tuple[str, ...]] = {
    "error_rate": ("p",),
    "truncated": ("events", "abrupt"),
    "huge": ("size", "status"),
    "redirect": ("location",),
    "tokenizer_panic": ("trigger",),
    "echo_auth": ("status",),
}
# The statuses a mode that reads ``status`` may answer.
_STATUSES: dict[str, tuple[int, ...]] = {"huge": (200, 500), "echo_auth": (400, 401, 500)}
_PIECE = 64 * 1024
_FILLER = b"x" * _PIECE  # one buffer, written again and again: a huge body costs no memory
# vLLM's answer when its engine core fails under a request (EngineDeadError).
ENGINE_ERROR_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
GARBAGE_BODY = b"<html><head><title>502 Bad Gateway</title></head><body>upstream sent nonsense\x00\xff</body></html>\n"
GZIP_GARBAGE_BODY = b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4  # a gzip magic number, then no valid deflate data


class FaultError(ValueError):
    """A fault description the simulator refuses; the message names the key."""


@dataclass(frozen=True)
class Fault:
    """One fault mode and its parameters (each used by one mode only)."""

    mode: str = "none"
    p: float = 1.0  # error_rate: share of completions answered 500
    events: int = 3  # truncated: SSE events sent before the stream ends
    abrupt: bool = False  # truncated: close the socket mid-body instead of ending the chunked body
    size: int = 16 * 1024 * 1024  # huge: body bytes
    status: int = 500  # huge: 500 (an error body) or 200 (a completion); echo_auth: 400, 401 or 500
    location: str = "/v1/moved"  # redirect: the Location header
    trigger: str = "surrogate"  # tokenizer_panic: "surrogate" (text UTF-8 cannot encode) or "any" completion

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FaultError(f"mode: unknown mode {self.mode!r}; choose from {', '.join(MODES)} (or revive)")
        if not 0.0 <= self.p <= 1.0:
            raise FaultError(f"p: must be between 0 and 1, got {self.p}")
        if self.events < 0:
            raise FaultError(f"events: must be >= 0, got {self.events}")
        if self.size < 1:
            raise FaultError(f"size: must be >= 1, got {self.size}")
        allowed = _STATUSES.get(self.mode, _STATUSES["huge"])
        if self.status not in allowed:
            raise FaultError(f"status: must be {' or '.join(map(str, allowed))}, got {self.status}")
        if self.trigger not in PANIC_TRIGGERS:
            raise FaultError(f"trigger: must be one of {', '.join(PANIC_TRIGGERS)}, got {self.trigger!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Fault:
        """A fault from a JSON object; unknown keys, wrong types and misplaced parameters are refused."""
        mode = data.get("mode", "none")
        if not isinstance(mode, str):
            raise FaultError(f"mode: must be a string, got {json.dumps(mode)}")
        mode = _ALIASES.get(mode, mode)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {"mode": mode}
        for key, value in data.items():
            if key == "mode":
                continue
            if key not in fields:
                raise FaultError(f"{key}: unknown parameter; known: {', '.join(n for n in fields if n != 'mode')}")
            if key not in _PARAMS.get(mode, ()):
                raise FaultError(f"{key}: does not apply to mode {mode!r}")
            values[key] = _typed(key, value, type(fields[key].default))
        return cls(**values)

    @classmethod
    def parse(cls, text: str) -> Fault:
        """A fault from the command line: ``MODE[:key=value,...]`` or a JSON object."""
        text = text.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except ValueError as error:
                raise FaultError(f"not valid JSON: {error}") from None
            if not isinstance(data, dict):
                raise FaultError("a JSON fault must be an object")
            return cls.from_mapping(data)
        mode, _, rest = text.partition(":")
        data = {"mode": mode}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, raw = item.partition("=")
            if not sep:
                raise FaultError(f"{item}: expected key=value")
            try:
                data[key.strip()] = json.loads(raw)
            except ValueError:
                data[key.strip()] = raw  # a bare string, e.g. a location
        return cls.from_mapping(data)

    def to_json(self) -> dict[str, Any]:
        """The mode and the parameters it uses."""
        return {"mode": self.mode, **{key: getattr(self, key) for key in _PARAMS.get(self.mode, ())}}


def _typed(key: str, value: object, kind: type) -> Any:
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (bool, str) and isinstance(value, kind):
        return value
    raise FaultError(f"{key}: must be {kind.__name__}, got {json.dumps(value)}")


class FaultSwitch:
    """The current fault of one engine: the HTTP server and the handler both read it."""

    def __init__(self, fault: Fault | None = None, *, seed: int = 0) -> None:
        self._fault = fault if fault is not None else Fault()
        self._changed = trio.Event()
        self._rng = random.Random(seed)

    @property
    def fault(self) -> Fault:
        return self._fault

    @property
    def listening(self) -> bool:
        """Whether the engine's port should accept connections (not while killed)."""
        return self._fault.mode != "kill"

    def set(self, fault: Fault) -> None:
        """Switch to ``fault`` now; waiters of ``wait_changed`` wake."""
        if fault != self._fault:
            log.info("fault: %s -> %s", self._fault.to_json(), fault.to_json())
        self._fault = fault
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return at the next ``set``."""
        await self._changed.wait()

    def draw(self, p: float) -> bool:
        """True with probability ``p`` (seeded: a run repeats)."""
        return self._rng.random() < p


def admin_response(switch: FaultSwitch, method: str, body: bytes) -> SimResponse:
    """``GET`` shows the fault; ``POST`` with a JSON object sets it (400 naming the bad key)."""
    if method == "GET":
        return SimResponse.json(200, switch.fault.to_json())
    if method != "POST":
        return SimResponse.error(ApiError(405, "use GET or POST for this path"))
    try:
        data = json.loads(body or b"{}")
        if not isinstance(data, dict):
            raise FaultError("the body must be a JSON object")
        fault = Fault.from_mapping(data)
    except (ValueError, UnicodeDecodeError) as error:  # FaultError is a ValueError
        return SimResponse.error(ApiError(400, str(error)))
    switch.set(fault)
    return SimResponse.json(200, fault.to_json())


class FaultInjector:
    """An engine's handler with its current fault applied; also serves ``/_sim/faults``."""

    def __init__(self, app: SimApp, switch: FaultSwitch) -> None:
        self.app = app
        self.switch = switch

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path == ADMIN_PATH:
            return admin_response(self.switch, method, body)
        fault = self.switch.fault
        completion = path in COMPLETION_PATHS
        if fault.mode == "kill":  # only in-process (a socket server stops listening instead)
            raise DropConnection("the engine is killed")
        if fault.mode == "hang" or (fault.mode == "half_dead" and completion):
            await trio.sleep_forever()
        if not completion or fault.mode == "none":
            return await self.app.handle(method, path, headers, body)
        stream = wants_stream(body)
        if fault.mode == "error_rate":
            if self.switch.draw(fault.p):
                return SimResponse(500, list(JSON_HEADERS), _error_body(ENGINE_ERROR_MESSAGE))
            return await self.app.handle(method, path, headers, body)
        if fault.mode == "garbage":
            return SimResponse(200, list(SSE_HEADERS if stream else JSON_HEADERS), GARBAGE_BODY)
        if fault.mode == "gzip_garbage":
            kind = SSE_HEADERS if stream else JSON_HEADERS
            return SimResponse(200, [*kind, ("content-encoding", "gzip")], GZIP_GARBAGE_BODY)
        if fault.mode == "redirect":
            return SimResponse(302, [("location", fault.location)])
        if fault.mode == "huge":
            return _huge(fault, stream)
        if fault.mode == "echo_auth":
            quoted = headers.get("authorization", "(none)")
            return SimResponse(fault.status, list(JSON_HEADERS), _error_body(f"request refused; it came with Authorization: {quoted}", fault.status))
        if fault.mode == "tokenizer_panic":
            if fault.trigger == "any" or _text_holds_lone_surrogate(body):
                log.info("tokenizer_panic: dropping the connection")
                raise DropConnection("tokenizer_panic: the tokenizer crashed on the request")
            return await self.app.handle(method, path, headers, body)
        assert fault.mode == "truncated"
        return _truncated(await self.app.handle(method, path, headers, body), fault)


def wants_stream(body: bytes) -> bool:
    """Whether a completion body asks for SSE (``"stream": true``); False for anything that is not a JSON object, nested too deep included."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return False
    return isinstance(request, dict) and request.get("stream") is True


def _text_holds_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body holds a string UTF-8 cannot encode; False for a body that is not JSON."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return holds_lone_surrogate(request)


def _error_body(message: str, status: int = 500) -> bytes:
    return ApiError(status, message).body()


def _huge(fault: Fault, stream: bool) -> SimResponse:
    """A body of ``fault.size`` bytes made of one reused 64 KiB buffer."""
    if fault.status == 500:
        head, tail = _split_around(_error_body("@@", 500))
        return SimResponse(500, [*JSON_HEADERS, ("content-length", str(fault.size))], stream=_filled(head, fault.size, tail))
    if stream:  # one giant SSE event, with no event boundary until its end
        head, tail = _split_around(b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"@@"},"finish_reason":null}]}\n\n')
        tail += b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
        return SimResponse(200, list(SSE_HEADERS), stream=_filled(head, fault.size, tail))
    completion = {
        "id": "chatcmpl-huge",
        "object": "chat.completion",
        "model": "huge",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "@@"}, "finish_reason": "length"}],
    }
    head, tail = _split_around(json.dumps(completion).encode())
    return SimResponse(200, [*JSON_HEADERS, ("content-length", str(fault.size))], stream=_filled(head, fault.size, tail))


def _split_around(template: bytes) -> tuple[bytes, bytes]:
    head, _, tail = template.partition(b"@@")
    return head, tail


async def _filled(head: bytes, size: int, tail: bytes) -> AsyncGenerator[bytes, None]:
    """``head``, filler, ``tail``: ``size`` bytes in all (at least head and tail)."""
    yield head
    left = max(0, size - len(head) - len(tail))
    while left:
        piece = _FILLER if left >= _PIECE else _FILLER[:left]
        left -= len(piece)
        yield piece
    yield tail


def _truncated(response: SimResponse, fault: Fault) -> SimResponse:
    """The engine's own answer, cut short (an error answer passes whole)."""
    if response.status != 200:
        return response
    if response.stream is None:
        body = response.body
        headers = [*response.headers, ("content-length", str(len(body)))]
        return SimResponse(200, headers, stream=_cut_body(body[: len(body) // 2]))
    return SimResponse(200, [*response.headers, ("connection", "close")], stream=_cut_stream(response.stream, fault))


async def _cut_body(part: bytes) -> AsyncGenerator[bytes, None]:
    yield part
    raise DropConnection("truncated: body cut short")


async def _cut_stream(stream: BodyStream, fault: Fault) -> AsyncGenerator[bytes, None]:
    """The first ``fault.events`` SSE events; then an end without ``[DONE]`` (or a dropped socket)."""
    left = fault.events
    try:
        async for chunk in stream:
            events = chunk.split(b"\n\n")
            complete = events[:-1]  # each chunk from the engine holds whole events
            if len(complete) >= left:
                if left:
                    yield b"".join(event + b"\n\n" for event in complete[:left])
                break
            left -= len(complete)
            yield chunk
    finally:
        await stream.aclose()  # the engine aborts the sequence
    if fault.abrupt:
        raise DropConnection("truncated: stream cut mid-body")


class AdminApp:
    """The admin port of a process of several engines: ``/_sim/faults/PORT`` reaches one.

    ``GET /_sim/faults`` lists every engine's fault by port. An engine's own
    port serves ``/_sim/faults`` too, but not while it is killed: this port does.
    """

    def __init__(self, switches: Mapping[int, FaultSwitch]) -> None:
        self.switches = switches

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path == ADMIN_PATH:
            if method != "GET":
                return SimResponse.error(ApiError(405, "use GET for this path; POST to /_sim/faults/PORT"))
            return SimResponse.json(200, {str(port): s.fault.to_json() for port, s in self.switches.items()})
        prefix = ADMIN_PATH + "/"
        if path.startswith(prefix):
            port = path[len(prefix) :]
            switch = self.switches.get(int(port)) if port.isdigit() else None
            if switch is None:
                return SimResponse.error(ApiError(404, f"no engine on port {port}; engines: {sorted(self.switches)}"))
            return admin_response(switch, method, body)
        return SimResponse.error(ApiError(404, f"no route for {path}"))
