"""Fresh request ids: version-4 UUIDs cut from the kernel's randomness, 4 KiB at a time.

One ``getrandom`` call serves 256 ids (``uuid4`` makes one per id, a system
call on every request), and unlike a seeded generator the next ids cannot be
predicted from the ones a caller has seen, so nobody can send an id that
will collide with another request's at vLLM.
"""

from __future__ import annotations

import os
import uuid

_BATCH = 4096


class IdSource:
    """Hands out fresh ids; one per process part that needs them (no global)."""

    __slots__ = ("_random",)

    def __init__(self) -> None:
        self._random = b""

    def fresh(self) -> str:
        """A new id: 32 lower-case hex digits."""
        if not self._random:
            self._random = os.urandom(_BATCH)
        fresh, self._random = self._random[:16], self._random[16:]
        return uuid.UUID(bytes=fresh, version=4).hex
