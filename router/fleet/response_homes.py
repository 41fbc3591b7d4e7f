"""Where each Responses API response lives: vLLM keeps a stored response in the memory of the engine that made it.

A turn that continues it (``previous_response_id``), and a retrieval or
cancellation of it (``GET /v1/responses/{id}``, ``.../cancel``), must reach
that engine: any other answers 404. The router learns the id from the answer
(a whole one's ``id``, a stream's ``response.created`` event) and remembers
its endpoint, the most recent ``LIMIT`` of them. Each process learns from
what it relayed: a replica that did not serve the first turn does not know
its home, and the turn goes where placement sends it (the engine then
answers for itself).
"""

from __future__ import annotations

from collections import OrderedDict

# Responses remembered per process: ~100 bytes each, so ~10 MB at most; older ones are forgotten first.
LIMIT = 100_000


class ResponseHomes:
    """The endpoint URL of each response id relayed lately, bounded to ``limit`` (least recently used out first)."""

    def __init__(self, limit: int = LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, endpoint_url: str) -> None:
        homes = self._homes
        homes[response_id] = endpoint_url
        homes.move_to_end(response_id)
        if len(homes) > self._limit:
            homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        """The endpoint that made ``response_id``, if this process relayed it and still remembers."""
        url = self._homes.get(response_id)
        if url is not None:
            self._homes.move_to_end(response_id)
        return url

    def __len__(self) -> int:
        return len(self._homes)
