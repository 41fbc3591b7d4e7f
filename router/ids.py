"""Fresh request ids: version-4 UUIDs cut from the kernel's randomness, 4 KiB at a time.

One ``getrandom`` call serves 256 ids (``uuid4`` makes one per id, a system
call on every request), and unlike a seeded generator the next ids cannot be
predicted from the ones a caller has seen, so nobody can send an id that
will collide with another request's at vLLM.
"""

from __future__ import annotations

import os

_BATCH = 4096


class IdSource:
    """Hands out fresh ids; one per process part that needs them (no global)."""

    __slots__ = ("_random", "_at")

    def __init__(self) -> None:
        self._random = b""
        self._at = _BATCH

    def fresh(self) -> str:
        """A new id: 32 lower-case hex digits, a version-4 UUID's (``uuid.UUID(hex=...)`` reads it back).

        The version and variant bits are set on the 16 bytes directly: building
        a ``uuid.UUID`` took ~3 us an id, this ~0.7 (bench/results/overhead/issue19).
        """
        at = self._at
        if at >= _BATCH:
            self._random, at = os.urandom(_BATCH), 0
        self._at = at + 16
        raw = bytearray(self._random[at : at + 16])
        raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
        raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
        return raw.hex()
