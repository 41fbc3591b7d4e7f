"""(d) The Mooncake trace replayed: prompts built block by block from ``hash_ids``, lengths scaled to the engines, time scaled to the fleet.

The trace gives each prompt as a chain of 512-token block ids (equal ids:
the same text after the same earlier blocks), no text. Each id becomes a
fixed piece of text (``block_text``), so equal chains give equal prompts
and the simulated prefix cache sees exactly the trace's reuse; the last
block is cut to the request's length. The trace's prompts (12k tokens on
average, up to 121k) do not fit engines of ``MAX_MODEL_LEN`` tokens, so
every length is divided by ``SCALE`` (a 512-token block becomes 64 tokens,
four 16-token cache blocks; outputs are divided alike, keeping the
prefill:decode ratio), and a prompt still over ``MAX_PROMPT_TOKENS`` keeps
its leading blocks that fit. Arrival times are stretched or squeezed so
the replay runs at ``load`` of the fleet's modelled capacity for the scaled
shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from bench.harness.mooncake import TraceRow, read_rows
from bench.prefix.model import Request, Workload
from bench.prefix.text import piece
from bench.prefix.workloads import Spec, fleet_capacity

SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"
TRACE_BLOCK_TOKENS = 512
SCALE = 8
BLOCK_TOKENS = TRACE_BLOCK_TOKENS // SCALE
MAX_PROMPT_TOKENS = 7000  # under tailguard's input cap with the template and an output beside


def block_text(hash_id: int) -> str:
    """The text of trace block ``hash_id``: BLOCK_TOKENS tokens, always the same for the same id."""
    return piece(f"mooncake:{hash_id}", BLOCK_TOKENS)


def prompt_of(row: TraceRow) -> tuple[str, bool]:
    """The row's scaled prompt, block by block, and whether it was cut to MAX_PROMPT_TOKENS."""
    tokens = math.ceil(row.input_length / SCALE)
    clipped = tokens > MAX_PROMPT_TOKENS
    tokens = min(tokens, MAX_PROMPT_TOKENS)
    parts: list[str] = []
    left = tokens
    for hash_id in row.hash_ids:
        if left <= 0:
            break
        parts.append(block_text(hash_id)[: 4 * min(left, BLOCK_TOKENS)])
        left -= BLOCK_TOKENS
    return "".join(parts), clipped


def pin_key(row: TraceRow, index: int) -> str:
    """What hand affinity pins a trace request by: its first block after the first (every request of the trace shares block 0)."""
    return f"blocks-{row.hash_ids[1]}" if len(row.hash_ids) > 1 else f"req-{index}"


def reusable_share(rows: Sequence[TraceRow]) -> float:
    """The share of all prompt blocks that an unbounded cache would hold when they arrive (a prefix seen before)."""
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for row in rows:
        total += len(row.hash_ids)
        for k in range(1, len(row.hash_ids) + 1):
            prefix = row.hash_ids[:k]  # a block is reusable when the whole prefix ending in it was seen
            reused += prefix in seen
            seen.add(prefix)
    return reused / total if total else 0.0


def replay(spec: Spec, rows: Sequence[TraceRow] | None = None) -> Workload:
    """The trace's requests at ``spec.load`` of the fleet's capacity for their scaled shapes; all of them measured after the warm-up."""
    rows = read_rows(SAMPLE) if rows is None else rows
    built = [prompt_of(row) for row in rows]
    outputs = [max(1, math.ceil(row.output_length / SCALE)) for row in rows]
    capacity = fleet_capacity([(len(text) // 4 + 7, out) for (text, _), out in zip(built, outputs)], spec.kv_cache_tokens)
    span_s = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000 if len(rows) > 1 else 0.0
    native = (len(rows) - 1) / span_s if span_s > 0 else math.inf
    stretch = native / (spec.load * capacity)  # GPU s of replay per trace s
    requests = tuple(
        Request((row.timestamp_ms - rows[0].timestamp_ms) / 1000 * stretch, "short", (("user", text),), out, pin_key(row, i))
        for i, (row, (text, _), out) in enumerate(zip(rows, built, outputs))
    )
    clipped = sum(1 for _, cut in built if cut)
    what = (
        f"{len(rows)} requests of the Mooncake conversation trace (FAST '25, kvcache-ai/Mooncake, Apache-2.0; "
        f"bench/prefix/data/README.md), lengths / {SCALE} (a 512-token block = {BLOCK_TOKENS} tokens), "
        f"{clipped} prompt(s) cut to their first {MAX_PROMPT_TOKENS} tokens; {reusable_share(rows):.0%} of the blocks are a prefix "
        f"seen before (an unbounded cache's hit rate); its {native:.2f} req/s replayed at "
        f"{spec.load * capacity:.1f} GPU req/s (x{1 / stretch:.1f})"
    )
    warmup = min(spec.warmup_s, requests[-1].at / 4)
    return Workload("mooncake", what, spec.load * capacity, capacity, warmup, requests[-1].at, requests=requests)
