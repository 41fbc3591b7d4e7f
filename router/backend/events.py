"""What a backend streams, checked on the way: SSE events relayed whole, each one JSON or ``[DONE]``, the usage and error events found."""

from __future__ import annotations

import json
import re

# OpenAI's and vLLM's error event (``{"error": {...}}``), Anthropic's and the Responses API's
# (``{"type": "error", ...}``), and a Responses stream's failed response.
_ERROR_EVENT = re.compile(rb'(?:^|\n)data:\s*(\{\s*(?:"error"\s*:|"type"\s*:\s*"(?:error|response\.failed)").*)')
_EVENT_END = re.compile(rb"\r?\n\r?\n")  # an SSE event ends with a blank line
_DONE = b"[DONE]"
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"')
# The last event of the other APIs' streams: Anthropic's message_stop, the Responses API's completed (or
# incomplete: cut at max_output_tokens) response. None has a [DONE].
_TERMINAL = re.compile(rb'"type"\s*:\s*"(?:message_stop|response\.completed|response\.incomplete)"')
_JSON = json.JSONDecoder()  # stateless; its raw_decode parses an event where it lies in a chunk
# An unfinished event kept back at most (a backend that never ends one is refused
# past it); the gRPC front end's SSE decoder refuses an event over the same size.
MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventFilter:
    """Lets a relayed SSE stream through in whole events, each checked; optionally without the usage event.

    Whole, whatever the reads' boundaries: a chunk that ends inside an event
    keeps that part back until the event's end comes (a client can do
    nothing with half an event, and one that got half of it before
    tailguard's own last error event would read the two as one broken
    event); past ``MAX_EVENT_BYTES`` without an end the stream is refused.

    Checked, because the gRPC front end must parse every event and refuses
    one that is not JSON: the HTTP relay reaches the same verdict for the
    same stream (BadBackendReply), never a 200 logged ``ok``. An event's data
    is what that front end's decoder (``server/grpc/sse.py``) takes from it, its
    ``data:`` lines joined by newlines, and must be ``[DONE]`` or a JSON
    object; events without data (comments, ``event:``) pass. At the first
    one refused, the events before it pass and ``refused`` says why; nothing
    passes after it. The usual chunk (whole single-line events in UTF-8,
    LF line ends) is decoded once and each event parsed where it lies
    (``raw_decode`` at its offset, no copy); anything else, or anything that
    fails there, takes the exact path (:func:`_event_problem`), which alone
    decides a refusal. ``python -m bench sse_check`` measures the cost per event.

    Without the usage event (``drop_usage``): tailguard asks every stream for
    usage (``stream_options.include_usage``: exact token counts even when
    vLLM merges tokens into one event); a caller who did not ask must not
    get the extra ``"choices": []`` event that brings, which some clients
    choke on. vLLM puts ``system_fingerprint`` on that event when usage is
    asked (on the last choice event when not), so the last event with a
    finish reason is kept back until the next one: when that is the usage
    event, its fingerprint moves onto it, as vLLM would have sent it.
    """

    __slots__ = ("_held", "_held_size", "_tail", "_drop_usage", "_check", "_finished", "refused")

    def __init__(self, *, drop_usage: bool = False, check: bool = True) -> None:
        self._check = check  # False: the reader parses every event itself (gRPC), once is enough
        self._held: list[bytes] = []  # the reads of an unfinished event, joined once its end comes
        self._held_size = 0
        self._tail = b""  # the last bytes held: an event's end may straddle two reads
        self._drop_usage = drop_usage
        self._finished = b""  # without usage: the last finishing event, kept back for the fingerprint
        self.refused: str | None = None  # why an event was refused ("is not JSON ..."); then nothing passes

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of ``chunk`` (and of what was held) to relay now."""
        if self.refused is not None:
            return b""
        if self._held:
            if _EVENT_END.search(self._tail + chunk) is None:  # only the new bytes are searched
                self._hold(chunk)
                return b""
            chunk = b"".join([*self._held, chunk])
            self._held, self._held_size, self._tail = [], 0, b""
        lf_only = b"\r" not in chunk
        if not (lf_only and chunk.endswith(b"\n\n")):  # the usual read ends on an event's end
            cut = _last_event_end(chunk)
            if cut < len(chunk):
                self._hold(chunk[cut:])
                chunk = chunk[:cut]
            if not chunk:
                return chunk
        if self._check and not (lf_only and _all_json_text(chunk)):
            bad = _first_bad_event(chunk)
            if bad is not None:
                at, self.refused = bad
                chunk = chunk[:at]
        if self._drop_usage and (self._finished or b'"usage"' in chunk or _FINISH_REASON.search(chunk) is not None):
            chunk = self._without_usage(chunk)
        return chunk

    def _without_usage(self, chunk: bytes) -> bytes:
        """``chunk`` (whole events) without its usage event, the last finishing event kept back (see the class)."""
        kept: list[bytes] = []
        start = 0
        for end in _EVENT_END.finditer(chunk):
            event = chunk[start : end.end()]
            start = end.end()
            usage = _usage_event(event) if b'"usage"' in event else None
            if self._finished:
                finished, self._finished = self._finished, b""
                fingerprint = None if usage is None else usage.get("system_fingerprint")
                kept.append(finished if fingerprint is None else _with_fingerprint(finished, fingerprint))
            if usage is not None:
                continue
            if _FINISH_REASON.search(event) is not None:
                self._finished = event
            else:
                kept.append(event)
        kept.append(chunk[start:])
        return b"".join(kept)

    def _hold(self, part: bytes) -> None:
        self._held.append(part)
        self._held_size += len(part)
        self._tail = (self._tail + part)[-3:]
        if self._held_size > MAX_EVENT_BYTES:
            self.refused = f"runs over {MAX_EVENT_BYTES} bytes without its end"
            self._held, self._held_size = [], 0

    def flush(self) -> bytes:
        """What is still held when the stream ends (an unfinished last event, relayed as it came)."""
        held = b"".join([self._finished, *self._held])
        self._held, self._held_size, self._tail, self._finished = [], 0, b"", b""
        return held


def _last_event_end(chunk: bytes) -> int:
    """Where the last whole event of ``chunk`` ends (0: none does)."""
    if b"\r" not in chunk:
        at = chunk.rfind(b"\n\n")
        return 0 if at < 0 else at + 2
    ends = list(_EVENT_END.finditer(chunk))
    return ends[-1].end() if ends else 0


def _all_json_text(chunk: bytes) -> bool:
    """Whether every event of ``chunk`` (whole events, LF line ends) is one ``data: `` line of ``[DONE]``
    or a JSON object in UTF-8. False proves nothing: the exact path looks again."""
    try:
        text = chunk.decode()
    except UnicodeDecodeError:
        return False
    decode = _JSON.raw_decode
    position, size = 0, len(text)
    while position < size:  # every turn moves past one event
        end = text.find("\n\n", position)
        if end < 0 or not text.startswith("data: ", position) or text.find("\n", position, end) >= 0:
            return False
        start = position + 6
        if end - start != 6 or not text.startswith("[DONE]", start):
            try:
                value, stop = decode(text, start)
            except (ValueError, RecursionError):
                return False
            if stop != end or type(value) is not dict:
                return False
        position = end + 2
    return True


def _first_bad_event(chunk: bytes) -> tuple[int, str] | None:
    """Where the first refused event of ``chunk`` (whole events) starts, and why; None when none is."""
    start = 0
    for end in _EVENT_END.finditer(chunk):
        problem = _event_problem(chunk[start : end.start()])
        if problem is not None:
            return start, problem
        start = end.end()
    return None


def _event_data(event: bytes) -> bytes | None:
    """One event's data as ``server/grpc/sse.py`` reads it: its ``data:`` lines joined by newlines (None: it has none)."""
    lines = (line[:-1] if line.endswith(b"\r") else line for line in event.split(b"\n"))
    data = [line[6:] if line.startswith(b"data: ") else line[5:] for line in lines if line.startswith(b"data:")]
    if not data:
        return None
    return data[0] if len(data) == 1 else b"\n".join(data)


def stream_ended(end: bytes) -> bool:
    """Whether a stream whose last bytes are ``end`` ended as a completion, read from the events' data
    as the gRPC front end reads it: the last event with data is ``[DONE]``, or some event's data there
    holds a finish reason. Bytes outside any ``data:`` line count for nothing (``xyz data: [DONE]`` is
    one line, of no data)."""
    data = [value for event in _EVENT_END.split(end) if (value := _event_data(event)) is not None]
    if data and data[-1] == _DONE:
        return True
    return any(_FINISH_REASON.search(value) is not None or _TERMINAL.search(value) is not None for value in data)


def _event_problem(event: bytes) -> str | None:
    """Why one event's data is refused, read as ``server/grpc/sse.py`` reads it; None when it passes."""
    value = _event_data(event)
    if value is None:
        return None
    if value == _DONE:
        return None
    try:
        payload = json.loads(value)
    except UnicodeDecodeError:
        return f"is not UTF-8 ({value[:40]!r})"
    except (ValueError, RecursionError):
        return f"is not JSON ({value[:40]!r})"
    return None if isinstance(payload, dict) else f"is not a JSON object ({value[:40]!r})"


def _usage_event(event: bytes) -> dict[str, object] | None:
    """An SSE event's payload when it is the usage event (``data: {..., "choices": [], "usage": {...}}``), else None."""
    data = event.strip()
    if not data.startswith(b"data:"):
        return None
    try:
        payload = json.loads(data[5:])
    except (ValueError, RecursionError):
        return None
    if isinstance(payload, dict) and payload.get("choices") == [] and isinstance(payload.get("usage"), dict):
        return payload
    return None


def _with_fingerprint(event: bytes, fingerprint: object) -> bytes:
    """One ``data:`` event with ``system_fingerprint`` set on its payload (an event that is not one JSON object stays)."""
    data = event.strip()
    try:
        payload = json.loads(data[5:])
    except (ValueError, RecursionError):
        return event
    if not isinstance(payload, dict):
        return event
    payload["system_fingerprint"] = fingerprint
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def first_error_event(data: bytes) -> bytes | None:
    """The first error event's data line in ``data`` (``{"error": ...}``, or ``{"type": "error", ...}``), if it has one."""
    if b'"error"' not in data:
        return None
    match = _ERROR_EVENT.search(data)
    return None if match is None else match.group(1)
