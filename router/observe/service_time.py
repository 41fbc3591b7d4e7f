"""Service time: how long a class's requests hold their seat, per token they may generate, learnt as they end.

A request seated too late to end by its class's ``e2e`` objective fails its
caller anyway, after its engine did the work. So a request waits for a seat
only until its deadline less the service it is predicted to need, not for a
fixed share of the deadline: a short job may wait nearly all of it, a long
one is refused while refusing still saves work (router/request_path.py).

The prediction is the class's recent mean of seated-to-end seconds per token
asked (``max_tokens``), times the request's own: it learns both how fast the
engines run the class lately and how much of ``max_tokens`` its requests
use. Nothing is predicted (0 s) until a request of the class has been served.
"""

from __future__ import annotations

from ..config import ClassConfig
from .telemetry import RequestRecord

__all__ = ["ServiceTime"]

WEIGHT = 0.05  # each served request's share in its class's mean: about the last 20-40 requests


class ServiceTime:
    """Each class's recent seated-to-end seconds per token asked (:meth:`observe` is a telemetry sink)."""

    def __init__(self) -> None:
        self._per_token: dict[str, float] = {}

    def observe(self, record: RequestRecord, klass: ClassConfig | None) -> None:
        """Learn from a finished request of ``klass``: only one served whole (a failure or a cut says nothing of its length)."""
        served = record.service_seconds
        if klass is None or served is None or served < 0 or not record.max_tokens:
            return
        sample = served / record.max_tokens
        mean = self._per_token.get(klass.name)
        self._per_token[klass.name] = sample if mean is None else mean + WEIGHT * (sample - mean)

    def predict(self, klass: str, max_tokens: int) -> float:
        """Seconds a request of ``klass`` asking ``max_tokens`` is expected to hold its seat (0 before any was served)."""
        return self._per_token.get(klass, 0.0) * max_tokens

    def forget(self, keep: set[str]) -> None:
        """Drop the classes not in ``keep`` (a reload removed them)."""
        for name in [name for name in self._per_token if name not in keep]:
            del self._per_token[name]
