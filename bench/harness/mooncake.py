"""The Mooncake trace's lines (Kimi's chat service, FAST '25): what ``prefix`` and ``trace`` both replay."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRow:
    """One line of the trace: ms after its start, lengths in tokens, the prompt's block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_rows(path: Path, limit: int | None = None) -> list[TraceRow]:
    """The trace's lines, in order (the first ``limit`` if given)."""
    rows: list[TraceRow] = []
    with path.open() as lines:
        for line in lines:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                rows.append(TraceRow(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), tuple(row["hash_ids"])))
    return rows
