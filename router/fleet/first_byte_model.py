"""How long one engine takes to a streamed call's first byte, learnt from its calls: the cost model's first piece.

vLLM prefills a call's prompt after the prompts queued before it (chunked,
first come first served within a priority), so the time from sending a
call to its first byte grows about linearly with the prompt tokens queued
ahead of it plus its own: ``base + seconds_per_token x tokens``. Each
engine's two numbers are fitted here, online, from what its calls took
(exponentially weighted least squares: the engine, its model and its
neighbours' load change, so old calls weigh less), and every prediction
is checked against what happened (``tailguard_first_byte_prediction_ratio``
on /metrics), so a model that is wrong shows, and corrects itself with the
next calls.

Placement does not read the prediction yet: it is the measure a
controller choosing engines by predicted cost (issue 35) will stand on.
Prompt tokens are the router's estimates, not what the engine found cached;
a prefix cache hit shows as a faster call than its tokens predict.
"""

from __future__ import annotations

__all__ = ["FirstByteModel"]

# Before any call is seen: an engine that answers an empty queue in 50 ms and prefills 10,000 tokens a second
# (a 7-8B model on one GPU is faster; the first calls correct it), held as two calls' worth of evidence.
PRIOR_BASE_S = 0.05
PRIOR_SECONDS_PER_TOKEN = 1e-4
_PRIOR_WEIGHT = 2.0
_PRIOR_SPREAD_TOKENS = 2_000.0  # the prior's two pseudo-calls: 0 and this many tokens
DECAY = 0.97  # each new call, the weight of all before it: about the last 30 calls count
_MIN_SECONDS_PER_TOKEN = 1e-7  # faster than any engine prefills (10 M tokens/s)
_MAX_SECONDS_PER_TOKEN = 1e-2  # slower than any (100 tokens/s)
_MAX_BASE_S = 10.0


class FirstByteModel:
    """``base + seconds_per_token x tokens`` for one engine, fitted to its calls (exponentially weighted)."""

    __slots__ = ("_n", "_x", "_xx", "_xy", "_y", "base", "calls", "seconds_per_token")

    def __init__(self) -> None:
        weight = _PRIOR_WEIGHT / 2
        x0, x1 = 0.0, _PRIOR_SPREAD_TOKENS
        y0, y1 = PRIOR_BASE_S, PRIOR_BASE_S + PRIOR_SECONDS_PER_TOKEN * _PRIOR_SPREAD_TOKENS
        self._n = 2 * weight
        self._x = weight * (x0 + x1)
        self._y = weight * (y0 + y1)
        self._xx = weight * (x0 * x0 + x1 * x1)
        self._xy = weight * (x0 * y0 + x1 * y1)
        self.base = PRIOR_BASE_S
        self.seconds_per_token = PRIOR_SECONDS_PER_TOKEN
        self.calls = 0  # calls learnt from

    def predict(self, tokens: int) -> float:
        """Seconds from sending a call to its first byte with ``tokens`` prompt tokens to prefill before it is done (its own included)."""
        return self.base + self.seconds_per_token * tokens

    def learn(self, tokens: int, seconds: float) -> None:
        """A call that had ``tokens`` to prefill (its own and those queued ahead) took ``seconds`` to its first byte."""
        if seconds < 0 or tokens < 0:
            return
        decay = DECAY
        x, y = float(tokens), seconds
        self._n = self._n * decay + 1.0
        self._x = self._x * decay + x
        self._y = self._y * decay + y
        self._xx = self._xx * decay + x * x
        self._xy = self._xy * decay + x * y
        self.calls += 1
        n = self._n
        variance = self._xx / n - (self._x / n) ** 2
        mean_x, mean_y = self._x / n, self._y / n
        if variance > 1.0:  # calls of different sizes: a slope can be told from them
            slope = (self._xy / n - mean_x * mean_y) / variance
            self.seconds_per_token = min(_MAX_SECONDS_PER_TOKEN, max(_MIN_SECONDS_PER_TOKEN, slope))
        self.base = min(_MAX_BASE_S, max(0.0, mean_y - self.seconds_per_token * mean_x))
