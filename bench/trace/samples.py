"""The committed trace samples: where they are and how they read."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from bench.harness.mooncake import TraceRow, read_rows

DATA = Path(__file__).resolve().parent / "data"
MOONCAKE = DATA / "mooncake_first1200.jsonl"  # the first 1,200 lines of the Mooncake conversation trace, unchanged
SHAREGPT = DATA / "sharegpt_pairs.csv"  # ShareGPT's first-turn (prompt, output) token lengths
ATTRIBUTION = DATA / "README.md"
FULL_MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def read_mooncake(path: Path = MOONCAKE, limit: int | None = None) -> list[TraceRow]:
    """The trace's first ``limit`` rows (all if None), in order."""
    return read_rows(path, limit)


def read_pairs(path: Path = SHAREGPT) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) pairs, one a CSV row after the header."""
    with path.open(newline="") as rows:
        reader = csv.reader(rows)
        next(reader)
        return [(int(prompt), int(output)) for prompt, output in reader]


def write_pairs(path: Path, pairs: Sequence[tuple[int, int]]) -> None:
    """Write pairs as ``read_pairs`` reads them."""
    with path.open("w", newline="") as rows:
        writer = csv.writer(rows, lineterminator="\n")
        writer.writerow(("prompt_tokens", "output_tokens"))
        writer.writerows(pairs)
