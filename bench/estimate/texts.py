"""The prompts ``python -m bench estimate`` measures: each kind of text a tokenizer treats differently, from a seed.

English prose and code are this checkout's own README and router sources
(what the numbers were measured on is recorded with them); everything else
is drawn from a ``random.Random(seed)``, so a run is the same on every machine.
"""

from __future__ import annotations

import base64
import json
import random
import re
import string
from collections.abc import Callable
from pathlib import Path

from bench.harness.procs import PROJECT_ROOT

# Some of the most frequent Chinese characters: what a model trained on Chinese merges first.
COMMON_CJK = "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出而要于就下得可你年生自会那后能过对多经行家十用发天如然作方成者"
CYRILLIC = "абвгдежзийклмнопрстуфхцчшщыэюя"


def prose_source() -> str:
    """The README's paragraphs of running text: no code blocks, tables, headings or list items."""
    text = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    paragraphs = [p for p in text.split("\n\n") if p.strip() and not p.lstrip().startswith(("|", "#", "-", "1.", "<", "    "))]
    return re.sub(r"`[^`]*`", "", "\n\n".join(paragraphs))


def code_source() -> str:
    """The router's sources, in path order."""
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(Path(PROJECT_ROOT / "router").glob("*.py")))


def _slice(source: str, rng: random.Random, size: int) -> str:
    start = rng.randrange(max(1, len(source) - size))
    return source[start : start + size]


def _chars(alphabet: str) -> Callable[[random.Random, int], str]:
    return lambda rng, size: "".join(rng.choice(alphabet) for _ in range(size))


def _spaced(alphabet: str, word: tuple[int, int]) -> Callable[[random.Random, int], str]:
    """Words of ``alphabet`` (``word`` long, inclusive) joined by spaces, ``size`` characters in all."""

    def make(rng: random.Random, size: int) -> str:
        words: list[str] = []
        length = 0
        while length < size:
            words.append("".join(rng.choice(alphabet) for _ in range(rng.randint(*word))))
            length += len(words[-1]) + 1
        return " ".join(words)[:size]

    return make


def _base64(rng: random.Random, size: int) -> str:
    return base64.b64encode(rng.randbytes(size)).decode()[:size]


def _digits(rng: random.Random, size: int) -> str:
    """Numbers as a CSV of measurements would hold them."""
    return ", ".join(f"{rng.uniform(0, 100_000):.{rng.randint(0, 3)}f}" for _ in range(size // 6 + 1))[:size]


def _json(rng: random.Random, size: int) -> str:
    records = [
        {"id": rng.randrange(10**6), "name": f"item-{rng.randrange(1000)}", "price": round(rng.uniform(0, 500), 2), "tags": rng.sample(["red", "blue", "new", "sale", "eu"], 2)}
        for _ in range(size // 60 + 1)
    ]
    return json.dumps(records)[:size]


def _cjk_rare(rng: random.Random, size: int) -> str:
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(size))


def _emoji(rng: random.Random, size: int) -> str:
    return "".join(chr(rng.randint(0x1F600, 0x1F64F)) for _ in range(size))


def makers(prose: str, code: str) -> dict[str, Callable[[random.Random, int], str]]:
    """Each kind of text by name: a function of (rng, characters) to one sample."""
    return {
        "english prose": lambda rng, size: _slice(prose, rng, size),
        "python code": lambda rng, size: _slice(code, rng, size),
        "json records": _json,
        "hex": _chars("0123456789abcdef"),
        "digits (csv)": _digits,
        "base64": _base64,
        "random letters, spaced": _spaced(string.ascii_lowercase, (3, 9)),
        "punctuation": _chars(string.punctuation),
        "punctuation, spaced": _spaced(string.punctuation, (1, 4)),
        "cjk common": _chars(COMMON_CJK),
        "cjk rare": _cjk_rare,
        "cyrillic words": _spaced(CYRILLIC, (3, 9)),
        "emoji": _emoji,
    }


# Characters a sample of each kind holds at most: the engine's 4,096-token context bounds the costliest (4 tokens a character).
MAX_CHARS = {"cjk common": 900, "cjk rare": 900, "emoji": 700, "cyrillic words": 1500}
DEFAULT_MAX_CHARS = 3500
