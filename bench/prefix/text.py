"""Deterministic prompt text of an exact token count: shared pieces by name, unique ones by number.

The simulator counts ASCII text at 4 characters a token and turns each
4-character chunk into a token id (``tailguard.sim.tokens``), so text of
exactly ``4 * tokens`` characters is ``tokens`` tokens, and two texts share
cached 16-token blocks exactly as far as their characters agree. A piece's
text depends only on its name: the same tenant, document or Mooncake block
id gives the same text in every run and every process.
"""

from __future__ import annotations

import hashlib

from tailguard.server.advise.replay.mix import long_document, request_nonce
from tailguard.sim.tokens import count_text_tokens

CHARS_PER_TOKEN = 4


def piece(name: str, tokens: int) -> str:
    """``tokens`` tokens of filler text that only ``name`` gives (exactly ``4 * tokens`` ASCII characters)."""
    if tokens <= 0:
        return ""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    chars = CHARS_PER_TOKEN * tokens
    text = long_document(chars + 1, seed=seed)[:chars]
    assert count_text_tokens(text) == tokens
    return text


def unique(number: int, tokens: int, *, seed: int) -> str:
    """``tokens`` tokens that begin with request ``number``'s nonce: no other request of the run shares its first block."""
    nonce = request_nonce(number, seed=seed)
    rest = tokens - len(nonce) // CHARS_PER_TOKEN
    return nonce + piece(f"unique:{seed}:{number}", max(rest, 0))
