"""Request bytes unique to each request, cheaply: one body encoded once, each request's nonce spliced in.

A prefix cache (vLLM's, the simulator's) would serve a prompt sent twice
from cache, and a benchmark that repeats one body would measure that cache,
not the policy. Bodies come from ``tailguard.server.advise.replay.mix``
(``unique_payload`` / ``unique_body_for``: a fixed-width nonce,
``mix.request_nonce``, at the start of the first message, and
``ignore_eos: true``); encoding an 8 kB body per request would cost the
client tens of microseconds, so ``UniqueRequests`` encodes request 0's body
once and, for request ``n``, replaces the nonce's bytes with ``n``'s. The
nonce has a fixed width, so the Content-Length never changes.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Callable, Mapping
from functools import partial

from bench.harness.client import CHAT_PATH, Source, http_request
from tailguard.server.advise.replay.mix import request_nonce, unique_body_for
from tailguard.server.advise.replay.trace import Arrival

BodyOf = Callable[[int], Mapping[str, object]]  # request number -> its body (the nonce of ``seed`` in it)
ShapeBody = Callable[..., Mapping[str, object]]  # (prompt, max_tokens, number, *, seed) -> a body, as mix.unique_body_for


def run_seed(*parts: object) -> int:
    """A nonce seed for one run of one set-up: stable across processes (CRC-32, not the salted ``hash()``).

    Engines outlive a set-up (several loads, several set-ups on one
    simulator): a seed of their own keeps one run's prompts from hitting the
    cache another run left.
    """
    return zlib.crc32(":".join(map(str, parts)).encode())


class UniqueRequests:
    """``request(n)``: the HTTP request of body ``body_of(n)``, built by splicing, not encoding.

    ``body_of`` must put ``mix.request_nonce(n, seed=seed)`` somewhere in
    its body, the same for every ``n`` but the nonce; checked at
    construction against request 1, so a body function that encodes
    anything else per request is refused (ValueError), never spliced wrong.
    """

    def __init__(self, port: int, path: str, body_of: BodyOf, *, seed: int = 0) -> None:
        self.seed = seed
        self._next = 0
        template = http_request(port, path, body_of(0))
        nonce = self._encoded(0)
        at = template.find(nonce)
        if at < 0 or template.find(nonce, at + 1) >= 0:
            raise ValueError("the body must hold request 0's nonce exactly once")
        self._head, self._tail = template[:at], template[at + len(nonce) :]
        if self.request(1) != http_request(port, path, body_of(1)):
            raise ValueError("the body differs between requests beyond the nonce")

    def _encoded(self, number: int) -> bytes:
        return json.dumps(request_nonce(number, seed=self.seed))[1:-1].encode()  # as it reads inside a JSON string

    def request(self, number: int) -> bytes:
        """Request ``number``'s bytes (a few microseconds: one nonce, two joins)."""
        return self._head + self._encoded(number) + self._tail

    def next_request(self) -> bytes:
        """The next request not yet handed out by this method (from 0): a ``Source`` for closed and open loops."""
        number, self._next = self._next, self._next + 1
        return self.request(number)

    def prebuilt(self, count: int) -> list[bytes]:
        """Requests 0 .. count-1, built before a run whose client must stay cheapest (a closed loop)."""
        return [self.request(number) for number in range(count)]


def repeated(request: bytes) -> Source:
    """The same bytes every time, where a repeat cannot be served from a cache (a prompt shorter than one 16-token block)."""
    return itertools.repeat(request).__next__


def unique_chat(port: int, body: Mapping[str, object], *parts: object) -> Source:
    """A ``Source`` of chat requests to ``port``: ``body`` with a nonce first (``prefixed``), seeded by ``parts`` (``run_seed``)."""
    seed = run_seed(*parts)
    return UniqueRequests(port, CHAT_PATH, partial(prefixed, body, seed=seed), seed=seed).next_request


def prefixed(body: Mapping[str, object], number: int, *, seed: int = 0) -> dict[str, object]:
    """``body`` (chat) with request ``number``'s nonce before its first message's text, and ``ignore_eos: true``.

    For the overhead benchmarks' own one-line bodies, which are not the mix's:
    three tokens longer, never shared.
    """
    messages = body["messages"]
    assert isinstance(messages, list)
    first = {**messages[0], "content": request_nonce(number, seed=seed) + str(messages[0]["content"])}
    return {**body, "messages": [first, *messages[1:]], "ignore_eos": True}


class ShapeRequests:
    """``play``'s ``request_of`` for traffic of shapes: arrival ``number`` gets its own nonce, each shape is encoded once per port.

    ``body`` is ``mix.unique_body_for`` or one with its signature (the
    tail benchmark's ``split-direct`` sends the body tailguard would forward).
    """

    def __init__(self, seed: int, body: ShapeBody = unique_body_for) -> None:
        self.seed = seed
        self._body = body
        self._shapes: dict[tuple[int, int, int], UniqueRequests] = {}

    def __call__(self, port: int, number: int, arrival: Arrival) -> bytes:
        shape = (port, arrival.prompt, arrival.max_tokens)
        requests = self._shapes.get(shape)
        if requests is None:
            body_of = partial(self._body, arrival.prompt, arrival.max_tokens, seed=self.seed)
            requests = self._shapes[shape] = UniqueRequests(port, CHAT_PATH, body_of, seed=self.seed)
        return requests.request(number)
