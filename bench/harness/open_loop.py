"""The traffic and the open loop of ``python -m bench tail``: schedules, a token-timing client, per-class statistics.

Times inside a schedule are real seconds; traces on disk are in GPU seconds
(real seconds divided by the simulator's time scale), so a trace recorded at
one time scale replays the same GPU load at another.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench.harness.client import TOKEN_MARKER, ConnectionPool, KeepAliveClient, ProtocolError, ReplyReader, Scan
from bench.harness.report import write_jsonl
from bench.harness.stats import percentiles
from tailguard.server.advise.replay.trace import Arrival


class _PieceReader(ReplyReader):
    """A ReplyReader that also gathers each piece of body (a chunk, or a whole Content-Length body) as it completes.

    A piece's token events are timed when the piece is whole, and the last
    piece is kept, so an error reply's JSON can say which error it was.
    """

    def __init__(self, on_piece: Callable[[bytes], None]) -> None:
        super().__init__()
        self.on_piece = on_piece
        self.token_times: list[float] = []
        self.last_piece = b""
        self._parts: list[bytes] = []

    def start(self, scan: Scan) -> None:
        super().start(scan)
        self.token_times, self.last_piece, self._parts = [], b"", []

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._parts.append(body)

    def on_chunk_complete(self) -> None:
        self._piece_done()

    def on_message_complete(self) -> None:
        self._piece_done()
        super().on_message_complete()

    def _piece_done(self) -> None:
        if self._parts:
            now = time.perf_counter()
            self.last_piece, self._parts = b"".join(self._parts), []
            self.token_times.extend([now] * self.last_piece.count(TOKEN_MARKER))
            self.on_piece(self.last_piece)


class TokenClient(KeepAliveClient):
    """KeepAliveClient that also notes when each token event arrives (for inter-token latency), and keeps the last piece of body."""

    def reader(self) -> _PieceReader:
        self._pieces = _PieceReader(self.piece)
        return self._pieces

    def piece(self, piece: bytes) -> None:
        """Called with each piece of body as it completes (a chunk, or a whole Content-Length body): a subclass's hook."""

    @property
    def token_times(self) -> list[float]:
        """perf_counter() of each token event of the last exchange, as its chunk completed."""
        return self._pieces.token_times

    @property
    def last_piece(self) -> bytes:
        """The last exchange's last piece of body (a chunk, or the whole Content-Length body)."""
        return self._pieces.last_piece


class TokenPool(ConnectionPool):
    """ConnectionPool of TokenClients (its rule on stale connections included)."""

    def _new(self) -> TokenClient:
        return TokenClient(self.port)

    def take(self) -> TokenClient:
        client = super().take()
        assert isinstance(client, TokenClient)
        return client


@dataclass
class Sample:
    """One request's fate; real seconds.

    ``e2e`` is what the client saw (connect, if a new connection was needed,
    to the last byte); ``router_e2e`` is what tailguard's access log says of
    the same request (from its ASGI call to its answer), when it was joined,
    and ``router_ttft`` its time to the backend's first token: what the client
    saw beyond it was spent on the way in and out of the router.
    """

    kind: str
    measured: bool
    lag: float
    request_id: str = ""
    at: float = 0.0  # when it was due, real s after the start
    sent: float = math.nan  # when it was sent, real s after the start
    outcome: str = "cut"  # ok | 429 | 503 | timeout | other | cut (still running at the bound)
    status: int | None = None
    code: str | None = None  # an error reply's error.code (queue_full, queue_timeout, ...)
    ttft: float | None = None
    e2e: float | None = None
    router_e2e: float | None = None
    router_ttft: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


_STATUS_OUTCOMES = {429: "429", 503: "503", 504: "timeout"}


def write_samples(path: Path, samples: Sequence[Sample]) -> None:
    """Every request's fate as JSONL (real s), for looking into a run after the fact."""
    keys = ("request_id", "kind", "at", "measured", "outcome", "status", "code", "ttft", "e2e", "router_e2e", "router_ttft", "tokens")
    write_jsonl(path, [{k: getattr(s, k) for k in keys} for s in samples])


def error_code(body: bytes) -> str:
    """``error.code`` of an OpenAI-shaped error body ("?" when there is none to read)."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type") or "?")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


def with_request_id(request: bytes, request_id: str) -> bytes:
    """``request`` with an ``x-request-id`` header after its request line (joins the access log)."""
    return request.replace(b"\r\n", b"\r\nx-request-id: " + request_id.encode() + b"\r\n", 1)


async def send_one(pool: TokenPool, request: bytes, sample: Sample) -> None:
    """One streaming request; fills ``sample``."""
    client = pool.take()
    start = time.perf_counter()
    sample.sent = start  # absolute here; ``play`` makes it relative to its start
    try:
        reply = await client.exchange(request, TOKEN_MARKER)
    except (OSError, trio.BrokenResourceError, ProtocolError):
        sample.outcome = "other"
        return
    finally:  # a request cut at the run's end keeps the tokens it had (served_tokens_per_s counts them)
        times = client.token_times
        sample.tokens = len(times)
        sample.ttft = times[0] - start if times else None
        sample.gaps = [b - a for a, b in zip(times, times[1:])]
        pool.give_back(client)
    sample.e2e, sample.status = time.perf_counter() - start, reply.status
    if reply.status != 200:
        sample.outcome = _STATUS_OUTCOMES.get(reply.status, "other")
        sample.code = error_code(client.last_piece)
    else:
        sample.outcome = "ok" if reply.done_seen and times else "other"
        if sample.outcome == "other":  # a stream that ended without [DONE]: its last event may be an error
            last = client.last_piece.strip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: ")
            sample.code = error_code(last) if b'"error"' in last else "no [DONE]"


async def play(
    targets: Mapping[str, Sequence[TokenPool]],
    request_of: Callable[[int, int, Arrival], bytes],
    arrivals: Sequence[Arrival],
    drain: float,
    label: str,
    progress: bool = True,
) -> tuple[list[Sample], float]:
    """Send each arrival on time, round robin over its class's pools; wait ``drain`` s at most after the last.

    ``request_of(port, number, arrival)`` gives the bytes of arrival
    ``number`` (its index) to ``port``: a number per request lets them be
    unique (``bench.harness.unique``).

    Each list of pools keeps its own turn: classes that share one list share
    one round robin, classes with lists of their own (a split) each have theirs.
    """
    samples: list[Sample] = []
    turns: dict[int, int] = {}  # id of a list in ``targets`` -> arrivals sent to it so far
    origin = time.perf_counter()
    last = arrivals[-1].at if arrivals else 0.0
    async with trio.open_nursery() as outer:
        if progress:  # several runs at once would overwrite each other's line
            outer.start_soon(_progress, label, samples, len(arrivals), origin)
        with trio.move_on_after(last + drain):
            async with trio.open_nursery() as nursery:
                for index, arrival in enumerate(arrivals):
                    await trio.sleep_until(trio.current_time() + arrival.at - (time.perf_counter() - origin))
                    choices = targets[arrival.kind]
                    turn = turns.get(id(choices), 0)
                    turns[id(choices)] = turn + 1
                    pool = choices[turn % len(choices)]
                    lag = time.perf_counter() - origin - arrival.at
                    sample = Sample(arrival.kind, arrival.measured, lag, request_id=f"tail-{index}", at=arrival.at)
                    samples.append(sample)
                    request = with_request_id(request_of(pool.port, index, arrival), sample.request_id)
                    nursery.start_soon(send_one, pool, request, sample)
        outer.cancel_scope.cancel()
    for sample in samples:
        sample.sent -= origin
    print(f"\r{_progress_line(label, samples, len(arrivals), origin)}", file=sys.stderr, flush=True)
    return samples, time.perf_counter() - origin


def token_times(sample: Sample) -> list[float]:
    """When each of the sample's tokens reached the client, real s after the start (empty if none came)."""
    if sample.ttft is None or math.isnan(sample.sent):
        return []
    times = [sample.sent + sample.ttft]
    for gap in sample.gaps:
        times.append(times[-1] + gap)
    return times


def served_tokens_per_s(samples: Sequence[Sample], kind: str, start: float, end: float, scale: float) -> float:
    """Tokens/s (GPU time) of class ``kind`` that reached the client between ``start`` and ``end`` (real s).

    Served throughput in the window, whether the request arrived before it
    or ends after it: over a window shorter than a long request, the only
    rate that says how much long work the engines do (a request cut by the
    run's end counts its tokens so far; one that failed counts none).
    """
    if end <= start:
        return math.nan
    tokens = 0
    for s in samples:
        if s.kind == kind and s.outcome in ("ok", "cut"):
            tokens += sum(1 for t in token_times(s) if start <= t < end)
    return tokens / ((end - start) / scale)


def _progress_line(label: str, samples: Sequence[Sample], total: int, origin: float) -> str:
    done = sum(1 for s in samples if s.e2e is not None or s.outcome != "cut")
    width = 20
    bar = "#" * int(width * len(samples) / max(total, 1))
    return f"  {label:<28} [{bar:<{width}}] sent {len(samples)}/{total} done {done} {time.perf_counter() - origin:5.0f} s"


async def _progress(label: str, samples: Sequence[Sample], total: int, origin: float) -> None:
    while True:
        print(f"\r{_progress_line(label, samples, total, origin)}", end="", file=sys.stderr, flush=True)
        await trio.sleep(1.0)


# -- statistics --------------------------------------------------------------------

FAST_REJECTION_MS = 10.0  # real ms: the bound on a rejection of a full queue


@dataclass
class RejectionStats:
    """How fast one kind of rejection (status + error code) came back.

    Real milliseconds, because a rejection is the router's own work (the
    GPU's time scale does not apply to it): ``client_ms`` as the load
    generator saw it, ``router_ms`` as tailguard's access log timed it (the
    difference is the socket, the HTTP parsing, and the client's own
    lag). ``gpu_ms`` is ``client_ms`` divided by the time scale, comparable
    to the class's deadline in GPU time.
    """

    n: int
    client_ms: dict[str, float]  # p50 / p99 / max, real
    router_ms: dict[str, float]  # p50 / p99 / max, real; NaN when no access line was joined
    gpu_ms: dict[str, float]  # p50 / p99, GPU time
    under_10ms: float  # share answered within FAST_REJECTION_MS, real, as the client saw it


@dataclass
class ClassStats:
    kind: str
    n: int
    outcomes: dict[str, int]
    ttft_ms: dict[str, float]  # p50 / p95 / p99, GPU time
    e2e_ms: dict[str, float]
    itl_ms: dict[str, float]  # p50 / p99
    goodput_tok_s: float  # completion tokens/s (GPU time) of the window's requests that finished
    rejections: dict[str, RejectionStats]  # by "status code", e.g. "429 queue_full"
    within_deadline: float | None  # share of ALL the class's requests that finished ok within the deadline
    ok_within_deadline: float | None  # share of the ones that finished ok that did so within the deadline
    e2e_sorted_ms: list[float] = field(repr=False, default_factory=list)  # for the CDF plot
    served_tok_s: float = math.nan  # tokens/s (GPU time) streamed in the window, see served_tokens_per_s
    ttft_sorted_ms: list[float] = field(repr=False, default_factory=list)  # for the TTFT CDF plot


def class_stats(
    kind: str,
    samples: Sequence[Sample],
    scale: float,
    window: float,
    deadline: float | None,
    queue_deadline: float | None = None,
    served_window: tuple[float, float] | None = None,
) -> ClassStats:
    """One class's numbers over the measured window; latencies divided by ``scale`` (GPU time).

    ``deadline`` (GPU s) is the one end-to-end latency is held to; ``queue_deadline``
    (GPU s) is the class's queue timeout, which tells a 503 queue_timeout refused
    at arrival from one that waited (see :func:`rejection_stats`).
    ``served_window`` (real s after the start) is where the served token rate is counted.
    """
    mine = [s for s in samples if s.kind == kind and s.measured]
    ok = [s for s in mine if s.outcome == "ok"]
    outcomes: dict[str, int] = {}
    for s in mine:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1

    def ms(values: Sequence[float | None]) -> list[float]:
        return sorted(v / scale * 1000 for v in values if v is not None)

    ttft, e2e = ms([s.ttft for s in ok]), ms([s.e2e for s in ok])
    itl = ms([g for s in ok for g in s.gaps])
    on_time = None if deadline is None else sum(1 for v in e2e if v <= deadline * 1000)
    return ClassStats(
        kind=kind,
        n=len(mine),
        outcomes=outcomes,
        ttft_ms=percentiles(ttft, (50, 95, 99)),
        e2e_ms=percentiles(e2e, (50, 95, 99)),
        itl_ms=percentiles(itl, (50, 99)),
        goodput_tok_s=sum(s.tokens for s in ok) / (window / scale) if window > 0 else math.nan,
        rejections=rejection_stats(mine, scale, queue_deadline),
        within_deadline=None if on_time is None or not mine else on_time / len(mine),
        ok_within_deadline=None if on_time is None or not ok else on_time / len(ok),
        e2e_sorted_ms=e2e,
        ttft_sorted_ms=ttft,
        served_tok_s=served_tokens_per_s(samples, kind, *served_window, scale) if served_window else math.nan,
    )


def rejection_stats(samples: Sequence[Sample], scale: float, queue_deadline: float | None = None) -> dict[str, RejectionStats]:
    """Per "status code" (429 queue_full, 503 queue_timeout, ...): how fast the rejections came back.

    With ``queue_deadline`` (GPU s), 503 queue_timeout is split in two: those
    answered within half the deadline were refused at arrival (fail fast),
    the others waited for a seat until the deadline.
    """
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        if s.outcome in ("429", "503") and s.e2e is not None:
            groups.setdefault(_rejection_kind(s, scale, queue_deadline), []).append(s)
    found: dict[str, RejectionStats] = {}
    for name, group in sorted(groups.items()):
        client = sorted(s.e2e * 1000 for s in group if s.e2e is not None)
        router = sorted(s.router_e2e * 1000 for s in group if s.router_e2e is not None)
        found[name] = RejectionStats(
            n=len(group),
            client_ms=percentiles(client, (50, 99)) | {"max": client[-1]},
            router_ms=percentiles(router, (50, 99)) | {"max": router[-1] if router else math.nan},
            gpu_ms=percentiles([v / scale for v in client], (50, 99)),
            under_10ms=sum(1 for v in client if v < FAST_REJECTION_MS) / len(client),
        )
    return found


def _rejection_kind(s: Sample, scale: float, queue_deadline: float | None) -> str:
    kind = f"{s.status} {s.code}"
    if s.code != "queue_timeout" or queue_deadline is None or s.e2e is None:
        return kind
    return f"{kind} at arrival" if s.e2e / scale < queue_deadline / 2 else f"{kind} after waiting"
