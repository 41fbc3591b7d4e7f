"""``python -m bench sse_check``: what ``BackendResponse.chunks`` costs per relayed SSE event, in process.

A micro-benchmark of the HTTP relay's own work (issue 20, defect 5: every
framed event checked to be JSON): no sockets, no engine. A backend's stream
of ``--events`` vLLM-shaped chat chunks (about 220 bytes each, then
``[DONE]``) is fed through :class:`~tailguard.router.backend.BackendResponse`
from an ``httpx.MockTransport``, once with ``--per-chunk`` events a read
(1: vLLM at engine pace; 8: several steps a read) and with the usage event
kept or dropped (``drop_usage``: a caller that did not ask for usage). The
same stream iterated through httpx alone is the baseline; the difference is
the relay's cost per event. The best of ``--repeats`` runs is reported
(a shared machine only ever adds time). Writes ``bench/results/sse_check.json``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import trio

from bench.harness.cli import driver_parser
from bench.harness.report import save_json
from tailguard.router.backend import BackendClient, HttpxTransport

RESULTS = Path(__file__).resolve().parent.parent / "results" / "sse_check.json"
EVENT = (
    b'data: {"id":"chatcmpl-3f2a9c1b7d","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" the"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
LAST = (
    b'data: {"id":"chatcmpl-3f2a9c1b7d","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"chatcmpl-3f2a9c1b7d","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":128,"total_tokens":137}}\n\n'
    b"data: [DONE]\n\n"
)


class _Body(httpx.AsyncByteStream):
    """The stream's reads, prepared before the clock starts."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read


def _reads(events: int, per_chunk: int) -> list[bytes]:
    reads = [EVENT * per_chunk for _ in range(events // per_chunk)]
    return [*reads, LAST]


async def _relay(reads: list[bytes], *, drop_usage: bool) -> float:
    """Seconds to relay the stream through ``BackendResponse.chunks``."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(reads))

    url = "http://127.0.0.1:9"
    transport = HttpxTransport(httpx.MockTransport(handler), url, connect_timeout=1.0)  # the relay alone: no wire, no parsing
    client = BackendClient(url, max_concurrency=1, connect_timeout=1.0, backend_transport=transport)
    response = await client.open("/v1/chat/completions", {}, {}, stream=True)
    started = time.perf_counter()
    await response.start()
    async for _ in response.chunks(drop_usage=drop_usage):
        pass
    elapsed = time.perf_counter() - started
    await response.aclose()
    return elapsed


async def _baseline(reads: list[bytes]) -> float:
    """Seconds to iterate the same stream through httpx alone."""
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(reads))
    started = time.perf_counter()
    async for _ in response.aiter_raw():
        pass
    return time.perf_counter() - started


async def _measure(events: int, per_chunks: Sequence[int], repeats: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for per_chunk in per_chunks:
        reads = _reads(events, per_chunk)
        count = (len(reads) - 1) * per_chunk + 3
        base = min([await _baseline(reads) for _ in range(repeats)])
        for drop_usage in (False, True):
            best = min([await _relay(reads, drop_usage=drop_usage) for _ in range(repeats)])
            rows.append(
                {
                    "events_per_read": per_chunk,
                    "drop_usage": drop_usage,
                    "events": count,
                    "relay_ns_per_event": round(best / count * 1e9),
                    "httpx_alone_ns_per_event": round(base / count * 1e9),
                    "relay_cost_ns_per_event": round((best - base) / count * 1e9),
                }
            )
    return rows


def main(argv: Sequence[str]) -> int:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--events", type=int, default=40_000, help="events per stream (default 40,000)")
    parser.add_argument("--per-chunk", type=int, nargs="+", default=[1, 8], help="events per backend read (default 1 8)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each, the best reported (default 7)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(f"sse-check: {args.events} events a stream, {args.per_chunk} events a read, best of {args.repeats}")
    rows = trio.run(_measure, args.events, args.per_chunk, args.repeats)
    print(f"{'events/read':>11} {'drop_usage':>10} {'relay ns/ev':>11} {'httpx ns/ev':>11} {'cost ns/ev':>10}")
    for row in rows:
        print(
            f"{row['events_per_read']:>11} {row['drop_usage']!s:>10} {row['relay_ns_per_event']:>11} "
            f"{row['httpx_alone_ns_per_event']:>11} {row['relay_cost_ns_per_event']:>10}"
        )
    save_json(args.out, {"events": args.events, "repeats": args.repeats, "rows": rows})
    return 0
