"""A generating request's way through the engine, shared by every route that generates: chat, completions, responses, messages.

vLLM runs each of these routes' requests the same way once its own request
model is read: the model name, the admission queue (503), the renderer's
checks, ``get_max_tokens``, ``SamplingParams``, then the engine. ``Generation``
holds those steps (each route calls them in its own order) and the
engine-side facts every answer reports: ``timing`` (vLLM's per-request
metrics) and ``cache_written`` (the prompt's blocks a request cached anew).

``SequenceStream`` is the frame of a one-sequence SSE stream (responses and
messages): its opening, one chunk of events per engine step, its closing;
closing it early aborts the sequence, as a client that hangs up does.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .api_errors import ApiError
from .engine import Engine, EngineQueueFull
from .metrics import SimMetrics
from .request import CompletionRequest, render, sample
from .sequence import Sequence

# QueueOverflowError / MaxQueuedTokensError (vllm/exceptions.py): 503, "Service Unavailable", no Retry-After.
QUEUE_FULL_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}
TIMING_FIELDS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")


@dataclass(frozen=True)
class Answer:
    """How this API answers: the parts of a body every response of a server shares."""

    model: str
    fingerprint: str
    prompt_tokens_details: bool  # vLLM's --enable-prompt-tokens-details
    cache_block: int | None  # the prefix cache's block size (None: no prefix caching)
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics


class Generation:
    """The steps a generating request takes into one engine, each raising the ``ApiError`` vLLM answers."""

    def __init__(self, engine: Engine, metrics: SimMetrics, *, retry_after: int | None, max_chars_per_token: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.retry_after = retry_after
        self.max_chars_per_token = max_chars_per_token

    def admit(self, sequences: int = 1) -> None:
        """vLLM's ``check_admission`` (its preflight): a full queue is a 503, before the renderer's checks."""
        try:
            self.engine.check_admission(sequences)
        except EngineQueueFull as error:
            self.metrics.admission_rejected(error.reason)
            headers = () if self.retry_after is None else (("retry-after", str(self.retry_after)),)
            raise ApiError(503, QUEUE_FULL_MESSAGES[error.reason], headers=headers) from None

    def render(self, request: CompletionRequest) -> int:
        """The renderer's checks and ``get_max_tokens``: the ``max_tokens`` the engine will run."""
        return render(request, self.engine.params.max_model_len, self.max_chars_per_token)

    def submit(self, request: CompletionRequest, max_tokens: int, request_id: str) -> list[Sequence]:
        """``SamplingParams``' checks, then the request's ``n`` sequences in the engine (vLLM fans n choices out)."""
        sample(request, max_tokens)
        return [
            self.engine.submit(
                request.prompt_tokens,
                max_tokens,
                prompt_key=request.prompt_key,
                seed=request.seed,
                min_tokens=request.min_tokens,
                ignore_eos=request.ignore_eos,
                request_id=request_id if not choice else f"{request_id}_{choice}",
                priority=request.priority,
                cache_salt=request.cache_salt,
                choice=choice,
            )
            for choice in range(request.n)
        ]

    async def finish(self, sequences: Seq[Sequence]) -> None:
        """Wait until every sequence has ended; a caller that goes away (its scope cancelled) frees the engine."""
        try:
            for sequence in sequences:
                await sequence.wait_finished()
        finally:
            for sequence in sequences:
                self.engine.abort(sequence)


def timing(sequence: Sequence) -> dict[str, float]:
    """vLLM's per-request metrics (``build_per_request_timing_metrics``) from the sequence's engine times, in ms:
    queued to scheduled, scheduled to first token, first to last token; a field whose times are unknown is left out
    (a stream's usage event drops nulls; a whole answer shows them, and ``speculative_decoding``, as null)."""
    ms: dict[str, float] = {}
    scheduled, first, last = sequence.scheduled_at, sequence.first_token_at, sequence.last_token_at
    tokens = len(sequence.token_ids)
    if scheduled is not None and first is not None:
        ms["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        ms["generation_time_ms"] = (last - first) * 1000
    if scheduled is not None:
        ms["queue_time_ms"] = (scheduled - sequence.arrival) * 1000
    if first is not None and last is not None and tokens > 1:
        ms["mean_itl_ms"] = (last - first) / (tokens - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        ms["tokens_per_second"] = tokens / (last - scheduled)
    return ms


def whole_timing(sequence: Sequence) -> dict[str, float | None]:
    """``timing`` as pydantic's ``model_dump`` writes it in a whole answer: every field, nulls and ``speculative_decoding`` too."""
    return dict.fromkeys(TIMING_FIELDS) | timing(sequence) | {"speculative_decoding": None}


def cache_written(sequence: Sequence, block: int | None) -> int:
    """The prompt's full blocks this sequence cached anew (vLLM's ``num_cache_creation_tokens``); 0 without a cache."""
    if block is None:
        return 0
    return (sequence.prompt_tokens // block - sequence.cached_tokens // block) * block


class SequenceStream:
    """SSE bytes of one sequence: an opening, then a chunk of events per engine step that made tokens, then a closing.

    Subclasses say what the events are (``tokens``, ``closing``; ``opening``
    is sent before the first token, at once). A chunk is never empty (an
    empty chunk would end a chunked body). ``aclose`` aborts a sequence
    still in the engine: a client that stops reading frees its seat and cache
    -- unless the stream is ``detached`` from it (a background response runs
    on without its reader).
    """

    def __init__(self, engine: Engine, sequence: Sequence, opening: bytes = b"", *, detached: bool = False) -> None:
        self.engine = engine
        self.sequence = sequence
        self._opening = opening
        self._detached = detached
        self._seen = 0
        self._done = False

    def __aiter__(self) -> SequenceStream:
        return self

    async def __anext__(self) -> bytes:
        if self._opening:
            out, self._opening = self._opening, b""
            return out
        sequence = self.sequence
        while not self._done:
            if len(sequence.token_ids) <= self._seen and not sequence.finished:
                await sequence.wait_for_tokens(self._seen)
            first = self._seen
            fresh = sequence.token_ids[first:]
            self._seen += len(fresh)
            out = self.tokens(fresh, first) if fresh else b""
            if sequence.finished:
                self._done = True
                if sequence.finish_reason != "abort":
                    out += self.closing()
            if out:
                return out
        raise StopAsyncIteration

    def tokens(self, token_ids: list[int], position: int) -> bytes:
        """The events of one step's new tokens (``position``: how many came before them)."""
        raise NotImplementedError

    def closing(self) -> bytes:
        """The events after the sequence's last token (not sent when it was aborted)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop reading: a sequence still in the engine is aborted at once (unless the stream is detached from it)."""
        self._done = True
        if not self._detached:
            self.engine.abort(self.sequence)


def sse(event: str, data: bytes) -> bytes:
    """One named SSE event (``event:`` and ``data:`` lines), as vLLM's responses and messages streams frame them."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
