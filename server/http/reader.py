"""The requests arriving on one connection, read by llhttp (httptools): sans-I/O, no socket here.

The RFC 9112 checks done here and by llhttp are listed in ``server/http/server.py``'s docstring.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import httptools

_CHUNK_LINE_BYTES = 64  # framing allowed per chunk of a chunked body (size line, extensions)
_VERSIONS = frozenset(("1.1", "1.0"))

@dataclass(frozen=True)
class Refusal:
    """A request the server will not serve: the answer, then close."""

    status: int
    message: str
    code: str = "bad_request"


class _Refused(Exception):
    """Raised from a parser callback: llhttp stops, ``RequestReader.feed`` records the refusal."""


class ParsedRequest:
    """One request's head, and its body as it arrives (llhttp fills it in)."""

    __slots__ = ("method", "target", "http_version", "headers", "keep_alive", "expect_continue", "body", "complete")

    def __init__(self, method: bytes, target: bytes, http_version: str, headers: list[tuple[bytes, bytes]], keep_alive: bool, expect_continue: bool) -> None:
        self.method = method
        self.target = target
        self.http_version = http_version
        self.headers = headers
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []  # arrived, not yet handed to the app
        self.complete = False  # the whole body arrived


class RequestReader:
    """The requests arriving on one connection, parsed by llhttp: a sans-I/O reader.

    ``feed`` hands bytes to llhttp, whose callbacks (the ``on_*`` methods)
    queue each request once its head is complete and add body bytes to it;
    a request that cannot be served becomes ``refusal``, after the requests
    before it, and nothing after it is parsed.

    The head's size: llhttp has no limit of its own. A head that arrived
    whole is measured from its parts when the bytes read for it could exceed
    the limit; a head still incomplete after a read is refused once the
    bytes read since the last request ended exceed the limit (bytes of the
    read in which that request ended are not counted, so an incomplete head
    is held to the limit plus one read at most). Chunked framing and trailers
    are bounded the same way.
    """

    __slots__ = (
        "_parser", "_limit", "queue", "refusal", "stopped", "_url", "_headers", "_hosts", "_expect", "_parsing", "_last",
        "_fed", "_feed_start", "_head_low", "_head_high", "_body_mark", "_body_seen", "_chunks",
    )

    def __init__(self, max_header_bytes: int) -> None:
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._limit = max_header_bytes
        self.queue: deque[ParsedRequest] = deque()
        self.refusal: Refusal | None = None
        self.stopped = False  # after an upgrade request: what follows is not ours to parse
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._hosts = 0
        self._expect = False
        self._parsing: ParsedRequest | None = None  # head complete, body not yet
        self._last: ParsedRequest | None = None
        self._fed = 0  # bytes fed to llhttp, all told
        self._feed_start = 0  # _fed before the current feed
        self._head_low = 0  # _fed before the feed in which the last request ended
        self._head_high = 0  # _fed after it
        self._body_mark = 0  # _fed after the feed in which the body being parsed began
        self._body_seen = 0  # body bytes since then
        self._chunks = 0

    def close(self) -> None:
        """Drop the parser (it holds this object's methods: a cycle otherwise left to the GC)."""
        self._parser = None

    @property
    def head_started(self) -> bool:
        """Whether some of the next request's head is buffered (after the queued ones)."""
        return self._fed > self._head_high or bool(self._url) or self._parsing is not None

    def feed(self, data: bytes) -> None:
        parser = self._parser
        if self.refusal is not None or self.stopped or parser is None:
            return  # llhttp stopped at the error; nothing after it is served
        self._feed_start = self._fed
        self._fed += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades are not served: that request is answered and the connection closed.
            if self._last is not None:
                self._last.keep_alive = False
            self.stopped = True
            return
        except httptools.HttpParserError as error:  # a _Refused from a callback comes as one too
            if self.refusal is None:
                self.refusal = _parser_refusal(error)
            return
        parsing = self._parsing
        if parsing is None:
            if self._fed - self._head_high > self._limit:
                self.refusal = Refusal(431, f"the request's head is over {self._limit} bytes")
        elif self._fed - self._body_mark - self._body_seen > self._limit + _CHUNK_LINE_BYTES * self._chunks:
            self.refusal = Refusal(431, f"the request's chunked framing and trailers are over {self._limit} bytes")

    def _refuse(self, refusal: Refusal) -> None:
        if self.refusal is None:
            self.refusal = refusal
        raise _Refused

    # llhttp's callbacks, in the order it calls them

    def on_url(self, url: bytes) -> None:
        self._url += url  # in pieces when the target arrives in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._parsing is not None:
            return  # a trailer of a chunked body: not passed on (bounded in ``feed``)
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp strips the whitespace before a value, not after
        self._headers.append((name, value))
        if name == b"host":
            self._hosts += 1
        elif name == b"transfer-encoding":
            if value.strip().lower() != b"chunked" or any(n == b"transfer-encoding" for n, _ in self._headers[:-1]):
                self._refuse(Refusal(501, f"unsupported transfer-encoding: {value.decode('latin-1')!r} (only chunked)"))
        elif name == b"expect":
            self._expect = value.strip().lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        version = parser.get_http_version()
        headers = self._headers
        if self._fed - self._head_low > self._limit:  # the bytes read could hold a head over the limit: measure it
            size = len(self._url) + sum(len(name) + len(value) + 4 for name, value in headers) + 24
            if size > self._limit:
                self._refuse(Refusal(431, f"the request's head is over {self._limit} bytes"))
        if version not in _VERSIONS:
            self._refuse(Refusal(505, f"HTTP/{version} is not supported (HTTP/1.1 and HTTP/1.0 are)"))
        if self._hosts != 1 and version == "1.1":
            self._refuse(Refusal(400, "an HTTP/1.1 request needs one Host header" + (" (it has several)" if self._hosts else "")))
        modern = version == "1.1"
        request = ParsedRequest(
            parser.get_method(), self._url, version, headers, modern and parser.should_keep_alive(), modern and self._expect
        )
        self._url = b""
        self._headers = []
        self._hosts = 0
        self._expect = False
        self._parsing = self._last = request
        self._body_mark = self._fed
        self._body_seen = self._chunks = 0
        self.queue.append(request)

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        assert request is not None
        request.body.append(body)
        self._body_seen += len(body)

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_message_complete(self) -> None:
        request = self._parsing
        assert request is not None
        request.complete = True
        self._parsing = None
        self._head_low = self._feed_start
        self._head_high = self._fed


def _parser_refusal(error: httptools.HttpParserError) -> Refusal:
    """llhttp's error as an answer: 501 for a transfer coding it refused, 400 otherwise."""
    reason = str(error)
    if "`Transfer-Encoding`" in reason:  # llhttp's reasons for a coding list that does not end in one chunked
        return Refusal(501, f"unsupported transfer-encoding ({reason}); only chunked")
    return Refusal(400, f"malformed HTTP request: {reason}")

