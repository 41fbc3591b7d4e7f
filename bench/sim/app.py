"""The simulator's OpenAI-compatible API, free of any I/O.

``SimApp.handle`` turns one HTTP request (method, path, headers, body) into a
``SimResponse``: a complete body, or a ``TokenStream`` of SSE bytes. The socket
server (``http.py``) and the in-process httpx transport (``transport.py``)
both drive it, so tests without sockets see exactly what a socket client sees.

Streams are framed by concatenating precomputed bytes: one chunk of bytes per
engine step per connection, however many tokens it carries, and no JSON
encoder on the per-token path.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .engine import Engine, EngineQueueFull, EngineRequestError, Sequence
from .metrics import SimMetrics
from .tokens import TOKEN_JSON, chat_prompt_key, count_chat_tokens, count_text_tokens, detokenize

JSON_HEADERS: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
SSE_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds of ``priority``


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


# The OpenAI "type" of an error by status, as vLLM's create_error_response
# names them (vllm/entrypoints/utils.py); 503 is the simulator's name for the
# queue-full refusal, whose type vLLM's source did not show us.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# vLLM's AuthenticationMiddleware answers a missing or wrong key with exactly this.
UNAUTHORIZED_BODY = b'{"error": "Unauthorized"}'


class ApiError(Exception):
    """A request the API refuses; rendered in vLLM's error shape (with any headers it needs)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind if kind is not None else _ERROR_TYPES.get(status, "BadRequestError")
        self.headers = headers

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}).encode()


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
class _Parsed:
    """What the engine needs from a completion request."""

    chat: bool
    prompt_tokens: int
    prompt_key: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None
    min_tokens: int
    ignore_eos: bool
    priority: int
    cache_salt: str | None
    n: int


class _Choice:
    """One of a stream's choices: its sequence, the tokens sent, and its event bytes around a token."""

    __slots__ = ("sequence", "index", "seen", "closed", "prefix", "suffix")

    def __init__(self, sequence: Sequence, index: int, head: str, *, chat: bool) -> None:
        self.sequence = sequence
        self.index = index
        self.seen = 0
        self.closed = False  # its finish reason was sent
        if chat:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"delta":{{"content":'.encode()
            self.suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"text":'.encode()
            self.suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'

    @property
    def ready(self) -> bool:
        """It has tokens not sent yet, or an end not told yet."""
        sequence = self.sequence
        return len(sequence.token_ids) > self.seen or (sequence.finished and not self.closed)


class TokenStream:
    """SSE bytes of one streaming request (each of its ``n`` choices' events by index); closing it early aborts them."""

    def __init__(self, engine: Engine, sequences: list[Sequence], *, chat: bool, model: str, include_usage: bool) -> None:
        self._engine = engine
        self._sequences = sequences
        self._include_usage = include_usage
        self._done = False
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + sequences[0].request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._head = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        self._choices = [_Choice(sequence, index, self._head, chat=chat) for index, sequence in enumerate(sequences)]
        if chat:
            self._pending = b"".join(
                self._event({"choices": [_chat_choice({"role": "assistant", "content": ""}, None, index)]}) for index in range(len(sequences))
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
        fresh = ids[choice.seen :]
        choice.seen = len(ids)
        prefix, suffix = choice.prefix, choice.suffix
        finished = sequence.finished and sequence.finish_reason != "abort"
        # As vLLM does, the last token's chunk carries the finish reason.
        last = fresh[-1:] if finished else []
        body = fresh[: len(fresh) - len(last)]
        # vLLM sends a chat stream's role chunk with the first output, after
        # the prefill: the first byte of a stream marks its first token.
        out = b"".join(prefix + TOKEN_JSON[i] + suffix for i in body)
        if last:
            reason = json.dumps(sequence.finish_reason).encode()
            out += prefix + TOKEN_JSON[last[0]] + suffix.replace(b'"finish_reason":null', b'"finish_reason":' + reason)
        if sequence.finished and not choice.closed:
            choice.closed = True
            if not last and sequence.finish_reason != "abort":  # finished without a new token: the reason goes alone
                out += self._event({"choices": [self._reason_choice(choice.index, sequence.finish_reason)]})
        return out

    def _reason_choice(self, index: int, reason: str | None) -> dict[str, Any]:
        if self._chat:
            return _chat_choice({}, reason, index)
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    async def aclose(self) -> None:
        """Stop reading: a sequence still in the engine is aborted at once."""
        self._done = True
        for sequence in self._sequences:
            self._engine.abort(sequence)

    def _event(self, fields: Mapping[str, Any]) -> bytes:
        return f"data: {self._head},{json.dumps(fields, separators=(',', ':'))[1:]}\n\n".encode()

    def _closing(self) -> bytes:
        out = b""
        if self._include_usage:
            out += self._event({"choices": [], "usage": _usage(self._sequences, cache_details=self._engine.params.prefix_caching)})
        return out + b"data: [DONE]\n\n"


def _chat_choice(delta: dict[str, Any], finish_reason: str | None, index: int = 0) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _usage(sequences: list[Sequence], *, cache_details: bool) -> dict[str, Any]:
    """The response's usage: the prompt once, every choice's output; ``prompt_tokens_details`` only with prefix caching on and a hit.

    vLLM sends it with ``--enable-prompt-tokens-details`` and only when
    ``num_cached_tokens`` is nonzero (``if self.enable_prompt_tokens_details
    and final_res.num_cached_tokens`` in its serving code).
    """
    first = sequences[0]
    completion = sum(len(sequence.token_ids) for sequence in sequences)
    usage: dict[str, Any] = {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
    }
    if cache_details and first.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": first.cached_tokens}
    return usage


class SimApp:
    """One engine's HTTP API: completions, models, health, tokenize, metrics.

    ``api_key`` is vLLM's ``--api-key``: every path under ``/v1`` then needs
    ``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}``
    otherwise), while ``/health``, ``/metrics`` and ``/tokenize`` stay open,
    as vLLM's AuthenticationMiddleware leaves every path outside ``/v1``.
    ``retry_after`` is the ``Retry-After`` (seconds) of the 503 that a full
    queue (``EngineParams.max_num_queued_reqs``) answers.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model: str,
        metrics: SimMetrics | None = None,
        api_key: str | None = None,
        retry_after: int = 1,
    ) -> None:
        if api_key == "":
            raise ValueError("api_key must not be empty (None means no key)")
        if retry_after < 0:
            raise ValueError(f"retry_after must not be negative, got {retry_after}")
        self.engine = engine
        self.model = model
        self.metrics = metrics if metrics is not None else SimMetrics(engine, model)
        self.api_key = api_key
        self.retry_after = retry_after
        self._ids = itertools.count()
        self._created = int(time.time())
        # The W3C traceparent of the latest completion requests that sent one, as
        # vLLM reads it to join the caller's trace (tests check what the router sends).
        self.traceparents: collections.deque[str] = collections.deque(maxlen=1000)

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        """Answer one request. Never raises for bad input: that is a 4xx response."""
        if self.api_key is not None and path.startswith("/v1") and method != "OPTIONS":
            if not _bearer_matches(headers.get("authorization"), self.api_key):
                return SimResponse(401, list(JSON_HEADERS), UNAUTHORIZED_BODY)
        try:
            if path in ("/v1/chat/completions", "/v1/completions"):
                _require(method, "POST")
                return await self._complete(path == "/v1/chat/completions", headers, body)
            if path == "/v1/models":
                _require(method, "GET")
                return SimResponse.json(200, self._models())
            if path == "/health":
                return SimResponse(200)
            if path == "/tokenize":
                _require(method, "POST")
                return SimResponse.json(200, self._tokenize(body))
            if path == "/metrics":
                _require(method, "GET")
                return SimResponse(200, [("content-type", self.metrics.content_type)], self.metrics.render())
            raise ApiError(404, f"no route for {path}")
        except ApiError as error:
            return SimResponse.error(error)

    async def _complete(self, chat: bool, headers: Mapping[str, str], body: bytes) -> SimResponse:
        parsed = self._parse(chat, _load_json(body))
        request_id = headers.get("x-request-id") or f"sim-{next(self._ids)}"
        traceparent = headers.get("traceparent")
        if traceparent is not None:
            self.traceparents.append(traceparent)
        sequences: list[Sequence] = []
        try:
            for choice in range(parsed.n):  # vLLM fans a request of n choices out into n sequences
                sequences.append(self.engine.submit(
                    parsed.prompt_tokens,
                    parsed.max_tokens,
                    prompt_key=parsed.prompt_key,
                    seed=parsed.seed,
                    min_tokens=parsed.min_tokens,
                    ignore_eos=parsed.ignore_eos,
                    request_id=request_id if not choice else f"{request_id}_{choice}",
                    priority=parsed.priority,
                    cache_salt=parsed.cache_salt,
                    choice=choice,
                ))
        except EngineRequestError as error:
            self._abort(sequences)
            raise ApiError(400, str(error)) from None
        except EngineQueueFull as error:
            self._abort(sequences)
            raise ApiError(
                503,
                f"The engine's queue is full: {error.in_flight} requests are in flight and "
                f"--max-num-queued-reqs is {error.limit}. Retry later or on another instance.",
                headers=(("retry-after", str(self.retry_after)),),
            ) from None
        echo = [("x-request-id", request_id)]
        if parsed.stream:
            stream = TokenStream(self.engine, sequences, chat=chat, model=self.model, include_usage=parsed.include_usage)
            return SimResponse(200, [*SSE_HEADERS, *echo], stream=stream)
        try:
            for sequence in sequences:
                await sequence.wait_finished()
        finally:
            # The caller went away (its cancel scope fired): free the GPU.
            self._abort(sequences)
        return SimResponse.json(200, self._completion_body(chat, sequences), echo)

    def _abort(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self.engine.abort(sequence)

    def _completion_body(self, chat: bool, sequences: list[Sequence]) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, sequence in enumerate(sequences):
            text = detokenize(sequence.token_ids)
            reason = sequence.finish_reason
            if chat:
                choices.append({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                })
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + sequences[0].request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": _usage(sequences, cache_details=self.engine.params.prefix_caching),
        }

    def _parse(self, chat: bool, request: dict[str, Any]) -> _Parsed:
        # vLLM validates the request's model (pydantic) before serving it.
        if request.get("stream_options") and not request.get("stream"):
            raise _validation_error("Stream options can only be defined when `stream=True`.", "stream_options")
        model = request.get("model", self.model)
        if model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")
        if chat:
            contents = _message_contents(request.get("messages"))
            _require_encodable(contents)
            prompt_tokens = count_chat_tokens(contents)
            prompt_key = chat_prompt_key(contents)
            exact = False
        else:
            prompt = request.get("prompt")
            _require_encodable(prompt if isinstance(prompt, list) else [prompt])
            prompt_tokens, prompt_key = _prompt_tokens(prompt)
            exact = not isinstance(prompt, str) and not (isinstance(prompt, list) and isinstance(prompt[0], str))
        max_tokens = _optional_int(request, "max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = _optional_int(request, "max_tokens")
        _check_lengths(self.engine.params.max_model_len, prompt_tokens, max_tokens, exact=exact)
        n = _optional_int(request, "n")
        if n is not None and n < 1:  # vLLM's SamplingParams check
            raise _validation_error(f"n must be at least 1, got {n}.", "n")
        stream = _optional_bool(request, "stream")
        options = request.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        include_usage = _optional_bool(options, "include_usage")
        # vLLM's request field (an int64, default 0; lower runs first): read
        # under either policy, used by the priority one (docs/vllm-priority.md).
        priority = _optional_int(request, "priority") or 0
        if not _INT64_MIN <= priority <= _INT64_MAX:
            raise ApiError(400, f"priority must be a 64-bit integer, got {priority}", param="priority")
        return _Parsed(
            chat=chat,
            prompt_tokens=prompt_tokens,
            prompt_key=prompt_key,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            seed=_optional_int(request, "seed"),
            min_tokens=_optional_int(request, "min_tokens") or 0,
            ignore_eos=_optional_bool(request, "ignore_eos"),
            priority=priority,
            cache_salt=_optional_str(request, "cache_salt"),
            n=n or 1,
        )

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "tailguard-sim",
                    "max_model_len": self.engine.params.max_model_len,
                }
            ],
        }

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        request = _load_json(body)
        if "messages" in request:
            contents = _message_contents(request["messages"])
            _require_encodable(contents)
            count = count_chat_tokens(contents)
        else:
            prompt = request.get("prompt")
            _require_encodable(prompt if isinstance(prompt, list) else [prompt])
            count, _ = _prompt_tokens(prompt)
        # Ids are positions, not a real vocabulary: only the count is meaningful.
        return {"count": count, "max_model_len": self.engine.params.max_model_len, "tokens": list(range(count))}


def _validation_error(message: str, param: str) -> ApiError:
    """A check of vLLM's request model: its validation handler's 400, typed "Bad Request", naming ``param``.

    vLLM raises these as ``VLLMValidationError`` inside a pydantic validator;
    the client reads pydantic's "Value error, " prefix and the error's
    "(parameter=...)" suffix. (vLLM also wraps the text in pydantic's
    error list; the simulator sends the one error's text.)
    """
    return ApiError(400, f"Value error, {message} (parameter={param})", param=param, kind="Bad Request")


def _check_lengths(limit: int, prompt_tokens: int, max_tokens: int | None, *, exact: bool) -> None:
    """vLLM's renderer and sampling checks of prompt and ``max_tokens`` against ``max_model_len``, in its words.

    The renderer refuses a prompt longer than the context leaves after the
    requested output; it tokenizes text only up to one token past that
    bound, so for text it can say only "at least" (token ids are counted
    exactly). Then ``max_tokens`` (absent: what the context leaves) must be
    at least 1. Messages as vLLM's ``renderers/params.py`` and
    ``SamplingParams`` write them (2026), ``VLLMValidationError``'s
    "(parameter=..., value=...)" suffix included.
    """
    requested = max_tokens or 0
    if prompt_tokens + requested > limit:
        if exact or requested >= limit:
            counted, total, bound = prompt_tokens, prompt_tokens + requested, ""
        else:
            counted, total, bound = limit - requested + 1, limit + 1, "at least "
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {requested} output "
            f"tokens and your prompt contains {bound}{counted} input tokens, for a total of {bound}{total} tokens. "
            f"Please reduce the length of the input prompt or the number of requested output tokens. "
            f"(parameter=input_tokens, value={counted})",
            param="input_tokens",
        )
    effective = max_tokens if max_tokens is not None else limit - prompt_tokens
    if effective < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {effective}. (parameter=max_tokens, value={effective})",
            param="max_tokens",
        )


def _bearer_matches(authorization: str | None, key: str) -> bool:
    """vLLM's check: scheme ``Bearer`` (any case), then the rest of the header is the key, compared in constant time."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def _require(method: str, expected: str) -> None:
    if method != expected:
        raise ApiError(405, f"use {expected} for this path")


def _load_json(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise ApiError(400, "the body must be a JSON object")
    return request


def _message_contents(messages: object) -> list[str]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    contents: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a string role", param="messages")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{index}].content parts must be text parts", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{index}].content must be a string or a list of parts", param="messages")
        contents.append(content)
    return contents


def _require_encodable(texts: list[Any]) -> None:
    """Refuse text UTF-8 cannot encode (a lone UTF-16 surrogate such as "\\ud866") with vLLM's 400.

    JSON allows such escapes and Python decodes them; vLLM's renderer fails
    to encode the text for the tokenizer and its error handler turns that
    ``UnicodeEncodeError`` (a ``ValueError``) into a 400 ``BadRequestError``
    carrying the codec's message. A tokenizer that panics instead, closing
    the connection without an answer, is the ``tokenizer_panic`` fault mode.
    """
    for text in texts:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ApiError(400, str(error)) from None


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


def _prompt_tokens(prompt: object) -> tuple[int, str]:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return max(1, count_text_tokens(prompt)), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), ",".join(map(str, prompt))
    raise ApiError(400, "prompt must be a string, a one-element list of strings, or a list of token ids", param="prompt")


def _optional_int(request: Mapping[str, Any], key: str) -> int | None:
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, got {json.dumps(value)}", param=key)
    return value


def _optional_str(request: Mapping[str, Any], key: str) -> str | None:
    value = request.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key} must be a string, got {json.dumps(value)}", param=key)
    return value


def _optional_bool(request: Mapping[str, Any], key: str) -> bool:
    value = request.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be a boolean, got {json.dumps(value)}", param=key)
    return value

