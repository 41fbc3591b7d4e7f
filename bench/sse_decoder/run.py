"""``python -m bench sse_decoder``: whether the gRPC side's SSE decoder stays linear on a long line cut small.

``server/grpc/sse.py`` promises decoding linear in the stream's size however
it is cut: a partial line is kept, never scanned again. The decoder it
replaced joined and re-split its whole pending buffer per chunk, a stall of
about a second per 64 MB line. This was a test with a wall-clock budget; a
CPU-speed claim belongs here, where it is measured and not asserted.

For each ``--sizes`` (MiB), the same bytes are fed in ``--piece``-byte
chunks two ways: as one event whose single ``data:`` line spans them all
(the case a quadratic decoder pays for), and, the baseline, appended to one
buffer and scanned once for a line end (the least any decoder does with
such a line). The figure is their ratio, measured in the same run on the
same machine: linear decoding keeps it from growing as the line grows (its
fixed cost a chunk weighs less on a longer line); a decoder that rescans
the pending line per chunk makes it grow with the size. The best of
``--repeats`` runs of each is taken (a shared machine only ever adds time).
Writes ``bench/results/sse_decoder.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness.cli import driver_parser
from bench.harness.report import save_json
from tailguard.server.grpc.sse import SseDecoder

RESULTS = Path(__file__).resolve().parent.parent / "results" / "sse_decoder.json"
MIB = 1024 * 1024


def _one_line(size: int, piece: bytes) -> float:
    """Seconds to decode one ``size``-byte line fed ``len(piece)`` bytes at a time."""
    decoder = SseDecoder(max_event_bytes=2 * size)
    started = time.perf_counter()
    decoder.feed(b"data: ")
    for _ in range(size // len(piece)):
        decoder.feed(piece)
    (event,) = decoder.feed(b"\n\n")
    elapsed = time.perf_counter() - started
    if len(event) != size // len(piece) * len(piece):
        raise RuntimeError(f"decoded {len(event)} bytes of a {size}-byte line: the benchmark measured something else")
    return elapsed


def _kept(size: int, piece: bytes) -> float:
    """Seconds to keep the same pieces in one buffer and look for a line end once (the baseline).

    What any decoder must do with a line that long: copy its bytes once and
    scan them once. A linear decoder costs a constant multiple of this.
    """
    started = time.perf_counter()
    buffer = bytearray(b"data: ")
    for _ in range(size // len(piece)):
        buffer += piece
    buffer += b"\n\n"
    buffer.find(b"\n")
    return time.perf_counter() - started


def measure(sizes: Sequence[int], piece_bytes: int, repeats: int) -> list[dict[str, float]]:
    """Per size (MiB): the best time of each way, and the long line's cost over the baseline's."""
    piece = b"x" * piece_bytes
    rows: list[dict[str, float]] = []
    for mib in sizes:
        size = mib * MIB
        line = min(_one_line(size, piece) for _ in range(repeats))
        base = min(_kept(size, piece) for _ in range(repeats))
        rows.append({"mib": mib, "line_s": line, "kept_s": base, "ratio": line / base})
    return rows


def main(argv: Sequence[str]) -> int:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64], help="line sizes in MiB (default 4 16 64)")
    parser.add_argument("--piece", type=int, default=16384, help="bytes a chunk (default 16384)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, the best taken (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(f"sse_decoder: one line of {args.sizes} MiB in {args.piece}-byte chunks vs keeping its bytes in one buffer, best of {args.repeats}")
    rows = measure(args.sizes, args.piece, args.repeats)
    print(f"{'MiB':>5} {'decoder / kept':>15} {'vs the smallest':>16}")
    for row in rows:
        print(f"{row['mib']:>5} {row['ratio']:>15.2f} {row['ratio'] / rows[0]['ratio']:>16.2f}")
    print("(linear: no growth as the line grows, its fixed cost a chunk weighing less; quadratic: growth with its size)")
    save_json(args.out, {"piece": args.piece, "repeats": args.repeats, "rows": rows})
    return 0
