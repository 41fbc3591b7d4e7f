"""The simulator's OpenAI-compatible API, free of any I/O, shaped as vLLM 0.32 answers.

``SimApp.handle`` turns one HTTP request (method, path, headers, body) into a
``SimResponse``: a complete body, or a ``TokenStream`` of SSE bytes. The socket
server (``http.py``) and the in-process httpx transport (``transport.py``)
both drive it, so tests without sockets see exactly what a socket client sees.

A completion request goes through vLLM's stages in its order
(``request.py``): its validation, the model name, the admission queue (503),
the renderer's length checks, ``SamplingParams``; then the engine. Bodies
carry vLLM's fields, nulls included, and ``system_fingerprint`` where vLLM
puts it.

Streams are framed by concatenating precomputed bytes: one chunk of bytes per
engine step per connection, however many tokens it carries, and no JSON
encoder on the per-token path (unless logprobs are asked for).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .api_errors import ApiError, RouteError
from .engine import Engine, EngineQueueFull
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import SimMetrics
from .request import (
    CHARS_PER_TOKEN,
    CompletionRequest,
    check_model,
    load_json_object,
    message_contents,
    parse,
    render,
    require_encodable,
    require_json_media,
    sample,
)
from .sequence import Sequence
from .tokens import TOKEN_JSON, count_chat_tokens, count_text_tokens, detokenize

__all__ = ["ApiError", "BodyStream", "DropConnection", "SimApp", "SimResponse", "TokenStream", "holds_lone_surrogate"]

VLLM_VERSION = "0.32.0"  # the vLLM the simulator answers as (/version, system_fingerprint)
JSON_HEADERS: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
SSE_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
)
# vLLM's AuthenticationMiddleware answers a missing or wrong key with exactly this.
UNAUTHORIZED_BODY = b'{"error": "Unauthorized"}'
# QueueOverflowError / MaxQueuedTokensError (vllm/exceptions.py): 503, "Service Unavailable", no Retry-After.
QUEUE_FULL_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}
# The methods each route takes (FastAPI answers others 405 with Allow); None: any (/metrics is a mounted app).
_ROUTES: dict[str, frozenset[str] | None] = {
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/health": frozenset({"GET"}),
    "/ping": frozenset({"GET", "POST"}),
    "/version": frozenset({"GET"}),
    "/tokenize": frozenset({"POST"}),
    "/metrics": None,
}


class DropConnection(Exception):
    """Close the connection without a response (or in the middle of one's body).

    A sick vLLM does this when its tokenizer panics on a request (the
    ``tokenizer_panic`` fault mode); the fault modes also use it to cut a
    body short. The in-process transport raises httpx's
    ``RemoteProtocolError`` instead, as httpx does over a socket.
    """


class BodyStream(Protocol):
    """A response body produced piece by piece; ``aclose`` when the reader stops early."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass
class SimResponse:
    """A response: either ``body`` or, for streams (and bodies written in pieces), ``stream``."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    stream: BodyStream | None = None

    @classmethod
    def json(cls, status: int, payload: object, extra: list[tuple[str, str]] | None = None) -> SimResponse:
        return cls(status, [*JSON_HEADERS, *(extra or [])], json.dumps(payload).encode())

    @classmethod
    def error(cls, error: ApiError) -> SimResponse:
        return cls(error.status, [*JSON_HEADERS, *error.headers], error.body())


@dataclass(frozen=True)
class _Answer:
    """How this API answers: the parts of a body every response of a server shares."""

    model: str
    fingerprint: str
    prompt_tokens_details: bool  # vLLM's --enable-prompt-tokens-details
    cache_block: int | None  # the prefix cache's block size (None: no prefix caching)
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics


class _Choice:
    """One of a stream's choices: its sequence, the tokens sent, and its event bytes around a token."""

    __slots__ = ("sequence", "index", "seen", "closed", "prefix", "middle", "plain", "tail", "offset")

    def __init__(self, sequence: Sequence, index: int, head: str, *, chat: bool) -> None:
        self.sequence = sequence
        self.index = index
        self.seen = 0
        self.closed = False  # its finish reason was sent
        self.offset = 0  # characters of output sent (completion logprobs' text_offset)
        if chat:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"delta":{{"content":'.encode()
            self.middle = b'},"logprobs":'
            self.tail = b',"stop_reason":null,"token_ids":null}]'  # after a finish reason
            self.plain = self.middle + b'null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"text":'.encode()
            self.middle = b',"logprobs":'
            self.tail = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            self.plain = self.middle + b'null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'

    @property
    def ready(self) -> bool:
        """It has tokens not sent yet, or an end not told yet."""
        sequence = self.sequence
        return len(sequence.token_ids) > self.seen or (sequence.finished and not self.closed)


class TokenStream:
    """SSE bytes of one streaming request (each of its ``n`` choices' events by index); closing it early aborts them.

    As vLLM 0.32 streams: a chat opens each choice with a role event; every
    token event carries the nulls vLLM's chunks carry; a choice's last
    event carries its finish reason, and ``system_fingerprint`` too unless
    a usage event follows, which then carries it.
    """

    def __init__(
        self, engine: Engine, sequences: list[Sequence], request: CompletionRequest, answer: _Answer, request_id: str
    ) -> None:
        chat = request.chat
        self._engine = engine
        self._sequences = sequences
        self._include_usage = request.include_usage
        self._logprobs = request.logprobs
        self._answer = answer
        self._done = False
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": answer.model,
        }
        self._head = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        self._choices = [_Choice(sequence, index, self._head, chat=chat) for index, sequence in enumerate(sequences)]
        fingerprint = json.dumps(answer.fingerprint).encode()
        self._closing_tail = b"}\n\n" if request.include_usage else b',"system_fingerprint":' + fingerprint + b"}\n\n"
        if chat:
            role = b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
            self._pending = b"".join(
                f'data: {self._head},"choices":[{{"index":{index},"delta":'.encode() + role for index in range(len(sequences))
            )
        else:
            self._pending = b""
        self._chat = chat

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        choices = self._choices
        waiting = next((c for c in choices if not c.closed), None)
        if waiting is not None and not any(c.ready for c in choices):
            await waiting.sequence.wait_for_tokens(waiting.seen)
        out = self._pending
        self._pending = b""
        for choice in choices:
            out += self._fresh(choice)
        if all(c.closed for c in choices):
            self._done = True
            if not any(c.sequence.finish_reason == "abort" for c in choices):
                out += self._closing()
        return out

    def _fresh(self, choice: _Choice) -> bytes:
        """One choice's new tokens as events, the last with its finish reason once it ended."""
        sequence = choice.sequence
        ids = sequence.token_ids
        first = choice.seen
        fresh = ids[first:]
        choice.seen = len(ids)
        finished = sequence.finished and sequence.finish_reason != "abort"
        # As vLLM does, the last token's chunk carries the finish reason.
        last = fresh[-1:] if finished else []
        body = fresh[: len(fresh) - len(last)]
        # vLLM sends a chat stream's role chunk with the first output, after
        # the prefill: the first byte of a stream marks its first token.
        if self._logprobs is None:
            prefix, plain = choice.prefix, choice.plain
            out = b"".join(prefix + TOKEN_JSON[i] + plain for i in body)
        else:
            out = b"".join(self._event(choice, token, first + n, None) for n, token in enumerate(body))
        if last:
            out += self._event(choice, last[0], first + len(body), sequence.finish_reason)
        if sequence.finished and not choice.closed:
            choice.closed = True
            if not last and sequence.finish_reason != "abort":  # finished without a new token: the reason goes alone
                out += self._event(choice, None, first, sequence.finish_reason)
        return out

    def _event(self, choice: _Choice, token: int | None, position: int, reason: str | None) -> bytes:
        """One token's event (or, with no token, a bare finish reason), logprobs and finish reason included."""
        text = TOKEN_JSON[token] if token is not None else b'""'
        if self._logprobs is None or token is None:
            logprobs = b"null"
        elif self._chat:
            logprobs = json.dumps(chat_logprobs([token], position, self._logprobs), separators=(",", ":")).encode()
        else:
            values, choice.offset = completion_logprobs([token], position, choice.offset, self._logprobs)
            logprobs = json.dumps(values, separators=(",", ":")).encode()
        if reason is None:
            return choice.prefix + text + choice.plain.replace(b"null", logprobs, 1)
        return choice.prefix + text + choice.middle + logprobs + b',"finish_reason":' + json.dumps(reason).encode() + choice.tail + self._closing_tail

    async def aclose(self) -> None:
        """Stop reading: a sequence still in the engine is aborted at once."""
        self._done = True
        for sequence in self._sequences:
            self._engine.abort(sequence)

    def _closing(self) -> bytes:
        out = b""
        if self._include_usage:
            usage = _usage(self._sequences, self._answer, chat=self._chat, stream=True)
            fields = {"choices": [], "usage": usage, "system_fingerprint": self._answer.fingerprint}
            if self._answer.per_request_metrics and len(self._sequences) == 1:  # vLLM leaves them out for n > 1
                fields["metrics"] = _timing(self._sequences[0])
            out += f"data: {self._head},{json.dumps(fields, separators=(',', ':'))[1:]}\n\n".encode()
        return out + b"data: [DONE]\n\n"


_TIMING_FIELDS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")


def _timing(sequence: Sequence) -> dict[str, float]:
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


def _usage(sequences: list[Sequence], answer: _Answer, *, chat: bool, stream: bool) -> dict[str, Any]:
    """A response's usage, as vLLM 0.32 counts and shapes it: the prompt once, every choice's output.

    ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``,
    and then always (``cached_tokens: 0`` included); a chat adds
    ``created_cache_tokens``, the prompt's full blocks it cached anew. A
    whole response carries the nulls (``prompt_tokens_details`` without the
    flag, ``completion_tokens_details``); a stream's usage leaves them out.
    """
    first = sequences[0]
    completion = sum(len(sequence.token_ids) for sequence in sequences)
    prompt = first.prompt_tokens
    details: dict[str, Any] | None = None
    if answer.prompt_tokens_details:
        created: int | None = None
        block = answer.cache_block
        if chat and block is not None:
            created = (prompt // block - first.cached_tokens // block) * block
        details = {"cached_tokens": first.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}
        if stream:
            details = {key: value for key, value in details.items() if value is not None}
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if stream:
        if details is not None:
            usage["prompt_tokens_details"] = details
        return usage
    usage["prompt_tokens_details"] = details
    usage["completion_tokens_details"] = None
    return usage


class SimApp:
    """One engine's HTTP API: completions, models, health, tokenize, metrics, version.

    ``api_key`` is vLLM's ``--api-key``: every path under ``/v1`` then needs
    ``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}``
    otherwise), while ``/health``, ``/metrics`` and ``/tokenize`` stay open,
    as vLLM's AuthenticationMiddleware leaves every path outside ``/v1``.
    ``enable_prompt_tokens_details``, ``enable_request_id_headers`` and
    ``enable_per_request_metrics`` are vLLM's flags of those names (all off
    by default, as in vLLM).
    ``max_chars_per_token`` is the tokenizer's longest token in characters:
    vLLM refuses a text over ``max_model_len`` times it before tokenizing
    (``input_text``); 4 is the simulator's own rule, a real tokenizer's is
    longer (80 on the real suite's tiny model), and then a text over the
    context is counted and refused by its tokens (``input_tokens``).
    ``retry_after`` adds a ``Retry-After`` (seconds) to the 503 of a full
    queue -- the simulator's own extra: vLLM sends none, so it is None by
    default.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model: str,
        metrics: SimMetrics | None = None,
        api_key: str | None = None,
        retry_after: int | None = None,
        enable_prompt_tokens_details: bool = False,
        enable_request_id_headers: bool = False,
        enable_per_request_metrics: bool = False,
        max_chars_per_token: int = CHARS_PER_TOKEN,
    ) -> None:
        if api_key == "":
            raise ValueError("api_key must not be empty (None means no key)")
        if retry_after is not None and retry_after < 0:
            raise ValueError(f"retry_after must not be negative, got {retry_after}")
        if max_chars_per_token < 1:
            raise ValueError(f"max_chars_per_token must be at least 1, got {max_chars_per_token}")
        self.max_chars_per_token = max_chars_per_token
        self.engine = engine
        self.model = model
        self.metrics = metrics if metrics is not None else SimMetrics(engine, model)
        self.api_key = api_key
        self.retry_after = retry_after
        self.enable_request_id_headers = enable_request_id_headers
        # vLLM's fingerprint is its version and a hash of its configuration: the engine's parameters here.
        config_hash = hashlib.sha256(f"{model}|{engine.params!r}".encode()).hexdigest()[:8]
        params = engine.params
        block = params.block_size if params.prefix_caching else None
        self._answer = _Answer(model, f"vllm-{VLLM_VERSION}-{config_hash}", enable_prompt_tokens_details, block, enable_per_request_metrics)
        self._ids = itertools.count()
        self._created = int(time.time())
        # The W3C traceparent of the latest completion requests that sent one, as
        # vLLM reads it to join the caller's trace (tests check what the router sends).
        self.traceparents: collections.deque[str] = collections.deque(maxlen=1000)

    @property
    def system_fingerprint(self) -> str:
        """What every completion answers as ``system_fingerprint`` (vLLM's ``--fingerprint-mode full``, one GPU)."""
        return self._answer.fingerprint

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        """Answer one request. Never raises for bad input: that is a 4xx response."""
        if self.api_key is not None and path.startswith("/v1") and method != "OPTIONS":
            if not _bearer_matches(headers.get("authorization"), self.api_key):
                return SimResponse(401, list(JSON_HEADERS), UNAUTHORIZED_BODY)
        try:
            _route(method, path)
            if path in ("/v1/chat/completions", "/v1/completions"):
                return await self._complete(path == "/v1/chat/completions", headers, body)
            if path == "/v1/models":
                return SimResponse.json(200, self._models())
            if path in ("/health", "/ping"):
                return SimResponse(200)
            if path == "/version":
                return SimResponse.json(200, {"version": VLLM_VERSION})
            if path == "/tokenize":
                return SimResponse.json(200, self._tokenize(headers, body))
            return SimResponse(200, [("content-type", self.metrics.content_type)], self.metrics.render())
        except RouteError as error:
            return SimResponse(error.status, [*JSON_HEADERS, *error.headers()], error.body())
        except ApiError as error:
            return SimResponse.error(error)

    async def _complete(self, chat: bool, headers: Mapping[str, str], body: bytes) -> SimResponse:
        request = parse(chat, headers.get("content-type"), body)
        check_model(request, self.model)
        given_id = headers.get("x-request-id")
        request_id = given_id or f"{next(self._ids):016x}"
        traceparent = headers.get("traceparent")
        if traceparent is not None:
            self.traceparents.append(traceparent)
        self._admit(request)
        max_tokens = render(request, self.engine.params.max_model_len, self.max_chars_per_token)
        sample(request, max_tokens)
        sequences: list[Sequence] = []
        for choice in range(request.n):  # vLLM fans a request of n choices out into n sequences
            sequences.append(
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
            )
        echo = [("x-request-id", given_id or f"{next(self._ids):032x}")] if self.enable_request_id_headers else []
        if request.stream:
            stream = TokenStream(self.engine, sequences, request, self._answer, request_id)
            return SimResponse(200, [*SSE_HEADERS, *echo], stream=stream)
        try:
            for sequence in sequences:
                await sequence.wait_finished()
        finally:
            # The caller went away (its cancel scope fired): free the GPU.
            for sequence in sequences:
                self.engine.abort(sequence)
        return SimResponse.json(200, self._completion_body(request, sequences, request_id), echo)

    def _admit(self, request: CompletionRequest) -> None:
        """vLLM's ``check_admission`` (its preflight): a full queue is a 503, before the renderer's checks."""
        try:
            self.engine.check_admission(request.n)
        except EngineQueueFull as error:
            self.metrics.admission_rejected(error.reason)
            headers = () if self.retry_after is None else (("retry-after", str(self.retry_after)),)
            raise ApiError(503, QUEUE_FULL_MESSAGES[error.reason], headers=headers) from None

    def _completion_body(self, request: CompletionRequest, sequences: list[Sequence], request_id: str) -> dict[str, Any]:
        chat, top = request.chat, request.logprobs
        choices: list[dict[str, Any]] = []
        for index, sequence in enumerate(sequences):
            text = detokenize(sequence.token_ids)
            reason = sequence.finish_reason
            if chat:
                logprobs = None if top is None else chat_logprobs(sequence.token_ids, 0, top)
                message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None}
                choices.append({
                    "index": index,
                    "message": {**message, "function_call": None, "reasoning": None},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                })
            else:
                logprobs = None if top is None else completion_logprobs(sequence.token_ids, 0, 0, top)[0]
                choices.append({
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                })
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self._answer.fingerprint,
            "usage": _usage(sequences, self._answer, chat=chat, stream=False),
        }
        if chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        timing: dict[str, Any] | None = None
        if self._answer.per_request_metrics and len(sequences) == 1:  # pydantic's model_dump: every field, nulls too
            timing = dict.fromkeys(_TIMING_FIELDS) | _timing(sequences[0]) | {"speculative_decoding": None}
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=timing)
        return body

    def _models(self) -> dict[str, Any]:
        """vLLM's model card: its fields, ``root`` the model served and one permission entry."""
        permission = {
            "id": f"modelperm-{hashlib.sha256(self.model.encode()).hexdigest()[:16]}",
            "object": "model_permission",
            "created": self._created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": self.model,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.engine.params.max_model_len,
            "permission": [permission],
        }
        return {"object": "list", "data": [card]}

    def _tokenize(self, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        require_json_media(headers.get("content-type"))
        request = load_json_object(body)
        if "messages" in request:
            contents = message_contents(request["messages"])
            require_encodable(contents)
            count = count_chat_tokens(contents)
        else:
            prompt = request.get("prompt")
            texts = prompt if isinstance(prompt, list) else [prompt]
            require_encodable(texts)
            if isinstance(prompt, str):
                count = max(1, count_text_tokens(prompt))
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                count = len(prompt)
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                count = max(1, count_text_tokens(prompt[0]))
            else:
                raise ApiError(400, "prompt must be a string, a one-element list of strings, or a list of token ids", param="prompt")
        # Ids are positions, not a real vocabulary: only the count is meaningful.
        return {"count": count, "max_model_len": self.engine.params.max_model_len, "tokens": list(range(count)), "token_strs": None}


def _route(method: str, path: str) -> None:
    """FastAPI's routing: an unknown path is a 404, a method the path does not take a 405 naming those it does."""
    if path not in _ROUTES:
        raise RouteError(404)
    allowed = _ROUTES[path]
    if allowed is not None and method not in allowed:
        raise RouteError(405, ", ".join(sorted(allowed)))


def _bearer_matches(authorization: str | None, key: str) -> bool:
    """vLLM's check: scheme ``Bearer`` (any case), then the rest of the header is the key, compared in constant time."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def holds_lone_surrogate(value: object) -> bool:
    """Whether any string in a decoded JSON value cannot be encoded as UTF-8 (iterative: nesting costs no stack)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False
