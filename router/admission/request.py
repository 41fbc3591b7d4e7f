"""The router's own request and routing records: no wire format, only meaning.

Front ends translate their wire request (OpenAI JSON, protobuf) into a
:class:`RouterRequest`; the router answers with a :class:`Routing` record of
the decisions it took, which front ends report back (headers, metadata).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidRequest
from ..observe import is_valid_request_id

# What a request asks of an engine, named by the API it came in on: OpenAI's chat and (legacy) completions,
# OpenAI's Responses API and Anthropic's Messages API. Each generates tokens on a seat; only chat and
# completion have a gRPC method and a whole answer tailguard can put together from a stream.
RequestKind = Literal["chat", "completion", "responses", "messages", "embeddings", "rerank"]
# Kinds whose prompt is chat messages (role and content): Anthropic's are shaped as OpenAI's.
MESSAGE_KINDS: frozenset[str] = frozenset({"chat", "messages"})
# The field each generating kind names its output bound by (the router's max_tokens); pooling kinds have none.
MAX_TOKENS_FIELD: dict[str, str] = {"chat": "max_tokens", "completion": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}
# Kinds that only prefill (an embedding model's or a reranker's): one output position a request, no decode.
POOLING: frozenset[str] = frozenset({"embeddings", "rerank"})
# The most inputs one pooling request may carry (an embeddings batch, a rerank's documents): OpenAI's bound.
MAX_POOLING_INPUTS = 2048

# Far above any real context window, far below what breaks JSON integers.
MAX_TOKENS_CEILING = 1 << 31

# Deepest nesting of objects and lists in a request, the body itself being
# level 1. Real bodies stay under ~30 (a JSON schema nested ten deep is ~25);
# the limit keeps every later json.dumps (the forwarded body) far from the
# interpreter's recursion limit, which RecursionError would turn into a 500.
MAX_JSON_DEPTH = 100

# The most work a body may cause (issue 32: 100,000 one-letter messages or empty
# text parts in 3 MB cost the event loop 0.2-0.5 s, five a second held the
# router at 97% CPU). Every check after decoding stops at these, with a 400:
# messages in a chat; content parts in all its messages together; JSON values
# in everything forwarded (each element of every object and list, a prompt of
# token ids aside: it is checked by length and range at C speed). Real
# requests stay far under them (an agent's long session: hundreds of
# messages; a large tool schema: thousands of values).
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
MAX_JSON_VALUES = 16_384

# Body fields the router reads as hints (router/admission/prefix_keys.py) that OpenAI defines as strings.
_STRING_HINTS = ("prompt_cache_key", "user")

# Integers the router forwards must fit 64 bits: what a backend's JSON parser
# and every OpenAI field (seeds, token ids, counts) can hold.
_INT_BOUND = 1 << 64


@dataclass(frozen=True)
class RouterRequest:
    """One completion request, as the core sees it.

    ``params`` holds every backend parameter the router does not interpret
    (``temperature``, ``top_k``, ``guided_json``, ``logprobs``, ...); it is
    sent to the backend untouched. ``deadline`` is the caller's own absolute
    Trio deadline (a gRPC deadline), if it has one. ``session`` is the value
    of the session header (``[server] session_header``; gRPC metadata of the
    same name), a hint for prefix-affinity placement, never forwarded.
    """

    kind: RequestKind
    request_id: str
    model: str | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | Sequence[str] | Sequence[int] | None = None
    max_tokens: int | None = None
    stream: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    caller: str | None = None
    forced_class: str | None = None
    deadline: float | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if self.kind in MESSAGE_KINDS:
            _check_messages(self.messages)
        elif self.kind == "completion":
            _check_prompt(self.prompt)
        elif self.prompt is not None or self.messages is not None:
            raise InvalidRequest(f"a {self.kind} request carries its input in its params")
        elif self.kind in POOLING:
            _check_pooling(self.kind, self.params)
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise InvalidRequest("max_tokens must be an integer", param="max_tokens")
            if not 1 <= self.max_tokens < MAX_TOKENS_CEILING:
                raise InvalidRequest(
                    f"max_tokens must be between 1 and {MAX_TOKENS_CEILING - 1}, got {self.max_tokens}",
                    param="max_tokens",
                )
        _check_sequences(self.params)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise InvalidRequest("model must be a non-empty string", param="model")
        if not isinstance(self.request_id, str) or not is_valid_request_id(self.request_id):
            # It goes to the backend as a header: no control characters, no line breaks.
            raise InvalidRequest("the request id must be 1 to 128 printable ASCII characters without spaces", param="x-request-id")
        _check_forwardable(self)

    def conversation(self) -> Sequence[Mapping[str, Any]] | None:
        """The prompt as chat messages in the order the engine's template reads them (None for a completion's prompt).

        Anthropic's ``system`` and the Responses API's ``instructions`` come
        first, as a system message; a Responses ``input`` string is one user
        message, its list of items the messages (a tool's output item has no
        ``content``: its other fields are still counted). Size estimates,
        prefix keys and conversation memory read every kind through this.
        """
        if self.kind == "chat":
            return self.messages or ()  # no copy: a chat's own messages, on every request's path
        if self.kind == "completion" or self.kind in POOLING:
            return None
        params = self.params
        lead = params.get("system") if self.kind == "messages" else params.get("instructions")
        turns: list[Mapping[str, Any]] = [{"role": "system", "content": lead}] if isinstance(lead, (str, list)) and lead else []
        if self.kind == "messages":
            return [*turns, *(self.messages or ())] if turns else (self.messages or ())
        given = params.get("input")
        if isinstance(given, str):
            return [*turns, {"role": "user", "content": given}]
        if isinstance(given, list):
            return turns + [item for item in given if isinstance(item, Mapping)]
        return turns

    def pooled_inputs(self) -> list[list[str]]:
        """A pooling request's inputs, each as the texts one engine pass reads (a rerank's query beside each document)."""
        params = self.params
        if self.kind == "embeddings":
            given = params.get("input")
            texts = [given] if isinstance(given, str) else given if isinstance(given, list) else []
            return [[text] for text in texts if isinstance(text, str)]
        if self.kind == "rerank":
            query = params.get("query")
            lead = [query] if isinstance(query, str) else []
            documents = params.get("documents")
            return [[*lead, _document_text(document)] for document in (documents if isinstance(documents, list) else [])]
        return []

    def texts(self) -> list[str]:
        """The prompt's texts, for size estimation (chat: one per message)."""
        conversation = self.conversation()
        if conversation is not None:
            return [message_text(m) for m in conversation]
        if self.kind in POOLING:
            return [text for texts in self.pooled_inputs() for text in texts]
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return [str(p) for p in prompt]
        return []

    @property
    def sequences(self) -> int:
        """The sequences the engine runs for it at once: ``n`` (and ``best_of``, where an engine still takes it).

        vLLM runs each of the ``n`` choices as a sequence of its own in its
        batch (a seat of ``--max-num-seqs``, and ``max_tokens`` of output
        each); an older engine's ``best_of`` runs that many and returns
        ``n``. Beam search's width is ``n`` too. Checked at construction.
        """
        params = self.params
        if "n" not in params and "best_of" not in params:
            return 1
        return max(_whole(params.get("n")), _whole(params.get("best_of")))

    def prompt_token_ids(self) -> int:
        """How many token ids the prompt gives directly (a list of ints; an embeddings batch of them), else 0."""
        prompt = self.prompt if self.kind == "completion" else self.params.get("input") if self.kind == "embeddings" else None
        if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt:
            if isinstance(prompt[0], int):
                return len(prompt)
            if self.kind == "embeddings" and isinstance(prompt[0], list):
                return sum(len(ids) for ids in prompt if isinstance(ids, list))
        return 0

    def largest_input_ids(self) -> int:
        """The longest input of an embeddings batch given as token ids (0: none is)."""
        given = self.params.get("input") if self.kind == "embeddings" else None
        if isinstance(given, list) and given:
            if isinstance(given[0], int):
                return len(given)
            return max((len(ids) for ids in given if isinstance(ids, list)), default=0)
        return 0


@dataclass(frozen=True)
class Routing:
    """What the router decided for a request; front ends report it to the caller."""

    request_id: str
    request_class: str
    pool: str
    endpoint: str
    prompt_tokens: int  # estimated
    requested_max_tokens: int | None
    max_tokens: int  # effective, sent to the backend
    clamped: bool
    queue_seconds: float


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one chat message: a string, or the text parts of a list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return ""


def _check_messages(messages: object) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages must be a non-empty list of messages", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(
            f"messages holds {len(messages)} messages, more than the {MAX_MESSAGES} one request may hold; "
            "summarize or drop the oldest turns",
            param="messages",
        )
    parts = 0
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{index}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{index}].role must be a non-empty string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"messages[{index}].content must be a string or a list of parts", param="messages")
        if isinstance(content, list):
            parts += len(content)
            if parts > MAX_CONTENT_PARTS:
                raise InvalidRequest(
                    f"the messages hold more than {MAX_CONTENT_PARTS} content parts in all (at messages[{index}]); "
                    "join adjacent text parts",
                    param="messages",
                )


# Parameters that make the engine run several sequences for one request (RouterRequest.sequences).
_SEQUENCE_PARAMS = ("n", "best_of")


def _whole(value: object) -> int:
    """A checked sequence count, or 1 where the field is absent (None)."""
    return value if isinstance(value, int) else 1


def _check_sequences(params: Mapping[str, Any]) -> None:
    """``n`` and ``best_of`` are whole numbers from 1 (null: the engine's default, 1): they decide the seats a request takes."""
    for name in _SEQUENCE_PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"{name} must be an integer", param=name)
        if not 1 <= value < MAX_TOKENS_CEILING:
            raise InvalidRequest(f"{name} must be at least 1, got {value}", param=name)


def _document_text(document: object) -> str:
    """A rerank document's text: a string, or an object's ``text``."""
    if isinstance(document, str):
        return document
    if isinstance(document, Mapping) and isinstance(document.get("text"), str):
        return str(document["text"])
    return ""


def _check_pooling(kind: str, params: Mapping[str, Any]) -> None:
    """An embeddings ``input`` (text, texts, token ids, lists of them) or a rerank's ``query`` and ``documents``, within MAX_POOLING_INPUTS."""
    if kind == "embeddings":
        given = params.get("input")
        if isinstance(given, str):
            return
        if not isinstance(given, list) or not given:
            raise InvalidRequest("input must be a string, a list of strings, or (lists of) token ids", param="input")
        if len(given) > MAX_POOLING_INPUTS:
            raise InvalidRequest(f"input holds {len(given)} items, more than the {MAX_POOLING_INPUTS} one request may; send several", param="input")
        return
    if not isinstance(params.get("query"), str):
        raise InvalidRequest("query must be a string", param="query")
    documents = params.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequest("documents must be a non-empty list", param="documents")
    if len(documents) > MAX_POOLING_INPUTS:
        raise InvalidRequest(f"documents holds {len(documents)} items, more than the {MAX_POOLING_INPUTS} one request may; send several", param="documents")


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, Sequence) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return
    raise InvalidRequest("prompt must be a string, a list of strings, or a list of token ids", param="prompt")


def _check_forwardable(request: RouterRequest) -> None:
    """Raise InvalidRequest, naming the field, for anything the router could
    not forward as valid UTF-8 JSON: a lone UTF-16 surrogate (a ``"\\ud866"``
    escape makes one; vLLM drops the connection on it), a non-finite number
    (NaN, Infinity, 1e999), an integer beyond 64 bits, a non-JSON value, or
    nesting deeper than MAX_JSON_DEPTH.

    One pass over what is forwarded, with an ASCII fast path per string
    (``str.isascii`` is O(1)): cheaper than one ``json.dumps(...).encode()``
    attempt, and it can say which field is wrong.
    """
    for hint in _STRING_HINTS:
        value = request.params.get(hint)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"{hint} must be a string", param=hint)
    budget = _Budget(MAX_JSON_VALUES)
    prompt = request.prompt
    if request.prompt_token_ids():  # checked as a list of ints already: only their range is left
        assert isinstance(prompt, Sequence)
        if not (-_INT_BOUND < min(prompt) and max(prompt) < _INT_BOUND):  # type: ignore[operator]
            raise InvalidRequest("prompt holds an integer out of range (over 64 bits)", param="prompt")
        prompt = None
    try:
        for name, value in (("model", request.model), ("messages", request.messages), ("prompt", prompt)):
            try:
                _check_json(value, 2, budget)
            except _Unfit as unfit:
                unfit.path.append(name)
                raise
        _check_json(dict(request.params), 1, budget)
    except _Unfit as unfit:
        where = _field_path(unfit.path)
        raise InvalidRequest(f"{where} {unfit.problem}", param=where) from None
    except _OverBudget:
        raise InvalidRequest(
            f"the request holds more than {MAX_JSON_VALUES} JSON values (objects, lists and their elements); "
            "send less structure in one request",
        ) from None


class _Budget:
    """JSON values the forwardability check may still walk (``MAX_JSON_VALUES``): it stops, refused, past them."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, values: int) -> None:
        self.left -= values
        if self.left < 0:
            raise _OverBudget


class _OverBudget(Exception):
    """The body holds more values than one request may (no path: the whole body is the problem)."""


class _Unfit(Exception):
    """A value the router cannot forward; ``path`` is filled in while unwinding."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str | int] = []


def _check_json(value: object, level: int, budget: _Budget) -> None:
    """Raise _Unfit for the first part of ``value`` that is not forwardable JSON, _OverBudget past ``budget``'s values.

    ``level`` is the nesting level ``value`` would have as a container. A
    container spends its length before its elements are looked at.
    """
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _Unfit("holds a lone UTF-16 surrogate, which is not valid Unicode text") from None
    elif isinstance(value, dict):
        if level > MAX_JSON_DEPTH:
            raise _Unfit(f"is nested too deeply (at most {MAX_JSON_DEPTH} levels of objects and lists)")
        budget.spend(len(value))
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Unfit("has a key that is not a string")
            try:
                _check_json(key, level, budget)
                _check_json(item, level + 1, budget)
            except _Unfit as unfit:
                unfit.path.append(key)
                raise
    elif isinstance(value, (list, tuple)):
        if level > MAX_JSON_DEPTH:
            raise _Unfit(f"is nested too deeply (at most {MAX_JSON_DEPTH} levels of objects and lists)")
        budget.spend(len(value))
        for index, item in enumerate(value):
            try:
                _check_json(item, level + 1, budget)
            except _Unfit as unfit:
                unfit.path.append(index)
                raise
    elif value is None or isinstance(value, bool):
        pass
    elif isinstance(value, int):
        if not -_INT_BOUND < value < _INT_BOUND:
            raise _Unfit("is an integer out of range (over 64 bits)")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _Unfit("is not a finite number")
    else:
        raise _Unfit(f"is not a JSON value ({type(value).__name__})")


def _field_path(path: list[str | int]) -> str:
    """``messages[0].content`` from the unwound path (innermost step first).

    Keys that are not plain identifiers are shown as escaped JSON strings, cut
    short: a raw key could itself hold the surrogate being reported. A path
    deeper than ten steps is cut (``...``).
    """
    parts: list[str] = []
    steps = path[::-1]
    for step in steps[:10]:
        if isinstance(step, int):
            parts.append(f"[{step}]")
        elif step.isascii() and step.isidentifier() and len(step) <= 64:
            parts.append(f".{step}" if parts else step)
        else:
            parts.append(f"[{json.dumps(step[:40])}]")
    if len(steps) > 10:
        parts.append("...")
    return "".join(parts) or "the request"
