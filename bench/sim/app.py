"""The simulator's vLLM API, free of any I/O, shaped as vLLM 0.32 answers: its routing, and the routes' small answers.

``SimApp.handle`` turns one HTTP request (method, path, headers, body) into a
``SimResponse``: a complete body, or a stream of SSE bytes. The socket server
(``http.py``) and the in-process httpx transport (``transport.py``) both drive
it, so tests without sockets see exactly what a socket client sees.

The routes are vLLM's for the engine's runner, each in its module:
a generating engine (vLLM's default runner) serves ``/v1/chat/completions``
and ``/v1/completions`` (``completions.py``), ``/v1/responses`` and
``/v1/responses/{id}[/cancel]`` (``responses.py``), ``/v1/messages`` and
``/v1/messages/count_tokens`` (``messages.py``); a pooling engine
(``runner="pooling"``, vLLM's ``--runner pooling --convert embed``) serves
``/v1/embeddings``, ``/pooling``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``,
``/score``, ``/v1/score`` (``pooling.py``) and none of the generating ones.
Both serve ``/tokenize`` and ``/detokenize`` (``tokenization.py``),
``/v1/models``, ``/health``, ``/ping``, ``/version`` and ``/metrics``. A path
the engine does not serve is FastAPI's 404, a method a path does not take its
405 with ``Allow``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import time
from collections.abc import Mapping
from typing import Any

from .api_errors import ApiError, RouteError
from .completions import Completions, TokenStream
from .engine import Engine
from .generation import QUEUE_FULL_MESSAGES, Answer, Generation
from .messages import Messages
from .metrics import SimMetrics
from .pooling import DEFAULT_EMBEDDING_SIZE, Pooling
from .request import CHARS_PER_TOKEN
from .responses import Responses
from .tokenization import detokenize, tokenize
from .wire import JSON_HEADERS, SSE_HEADERS, BodyStream, DropConnection, SimResponse

__all__ = [
    "JSON_HEADERS",
    "QUEUE_FULL_MESSAGES",
    "RUNNERS",
    "SSE_HEADERS",
    "ApiError",
    "BodyStream",
    "DropConnection",
    "SimApp",
    "SimResponse",
    "TokenStream",
    "holds_lone_surrogate",
]

VLLM_VERSION = "0.32.0"  # the vLLM the simulator answers as (/version, system_fingerprint)
RUNNERS = ("generate", "pooling")  # vLLM's --runner: a generative model, or a pooling one (--convert embed)
# vLLM's AuthenticationMiddleware answers a missing or wrong key with exactly this, on these paths only.
UNAUTHORIZED_BODY = b'{"error": "Unauthorized"}'
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
_POST = frozenset({"POST"})
_GET = frozenset({"GET"})
# The methods each route takes (FastAPI answers others 405 with Allow); None: any (/metrics is a mounted app).
_COMMON_ROUTES: dict[str, frozenset[str] | None] = {
    "/v1/models": _GET,
    "/health": _GET,
    "/ping": frozenset({"GET", "POST"}),
    "/version": _GET,
    "/tokenize": _POST,
    "/detokenize": _POST,
    "/metrics": None,
}
_GENERATE_ROUTES: dict[str, frozenset[str] | None] = {
    "/v1/chat/completions": _POST,
    "/v1/completions": _POST,
    "/v1/responses": _POST,
    "/v1/responses/{response_id}": _GET,
    "/v1/responses/{response_id}/cancel": _POST,
    "/v1/messages": _POST,
    "/v1/messages/count_tokens": _POST,
}
_POOLING_ROUTES: dict[str, frozenset[str] | None] = {
    path: _POST for path in ("/v1/embeddings", "/pooling", "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score")
}
_GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})


class SimApp:
    """One engine's HTTP API, vLLM's routes for its runner (the module's docstring lists them).

    ``api_key`` is vLLM's ``--api-key``: every path under ``/v1``, ``/v2``,
    ``/inference`` and ``/cohere`` then needs ``Authorization: Bearer
    <key>`` (401 ``{"error": "Unauthorized"}`` otherwise; an Anthropic
    client's ``x-api-key`` is not read, as vLLM reads none), while
    ``/health``, ``/metrics``, ``/tokenize``, ``/rerank`` and ``/score`` stay
    open, as vLLM's AuthenticationMiddleware leaves every other path.
    ``enable_prompt_tokens_details``, ``enable_request_id_headers`` and
    ``enable_per_request_metrics`` are vLLM's flags of those names (all off
    by default, as in vLLM); ``enable_responses_api_store`` is its
    ``VLLM_ENABLE_RESPONSES_API_STORE`` (``responses.py``).
    ``max_chars_per_token`` is the tokenizer's longest token in characters:
    vLLM refuses a text over ``max_model_len`` times it before tokenizing
    (``input_text``); 4 is the simulator's own rule, a real tokenizer's is
    longer (80 on the real suite's tiny model), and then a text over the
    context is counted and refused by its tokens (``input_tokens``).
    ``retry_after`` adds a ``Retry-After`` (seconds) to the 503 of a full
    queue -- the simulator's own extra: vLLM sends none, so it is None by
    default. ``runner`` is vLLM's ``--runner`` ("generate", or "pooling" for
    an embedding model: ``--runner pooling --convert embed``), whose vectors
    have ``embedding_size`` dimensions (the simulator's own setting; a
    model's hidden size in vLLM).
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
        enable_responses_api_store: bool = False,
        max_chars_per_token: int = CHARS_PER_TOKEN,
        runner: str = "generate",
        embedding_size: int = DEFAULT_EMBEDDING_SIZE,
    ) -> None:
        if api_key == "":
            raise ValueError("api_key must not be empty (None means no key)")
        if retry_after is not None and retry_after < 0:
            raise ValueError(f"retry_after must not be negative, got {retry_after}")
        if max_chars_per_token < 1:
            raise ValueError(f"max_chars_per_token must be at least 1, got {max_chars_per_token}")
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
        self.max_chars_per_token = max_chars_per_token
        self.engine = engine
        self.model = model
        self.runner = runner
        self.metrics = metrics if metrics is not None else SimMetrics(engine, model)
        self.api_key = api_key
        self.retry_after = retry_after
        self.enable_request_id_headers = enable_request_id_headers
        # vLLM's fingerprint is its version and a hash of its configuration: the engine's parameters here.
        config_hash = hashlib.sha256(f"{model}|{engine.params!r}".encode()).hexdigest()[:8]
        params = engine.params
        block = params.block_size if params.prefix_caching else None
        answer = Answer(model, f"vllm-{VLLM_VERSION}-{config_hash}", enable_prompt_tokens_details, block, enable_per_request_metrics)
        self._answer = answer
        self._ids = itertools.count()
        self._created = int(time.time())
        generation = Generation(engine, self.metrics, retry_after=retry_after, max_chars_per_token=max_chars_per_token)
        self._completions = Completions(generation, answer)
        self._responses = Responses(generation, answer, self._new_id, store=enable_responses_api_store)
        self._messages = Messages(generation, answer)
        self._pooling = Pooling(generation, answer, embedding_size=embedding_size)
        self._routes = {**_COMMON_ROUTES, **(_POOLING_ROUTES if runner == "pooling" else _GENERATE_ROUTES)}
        # The W3C traceparent of the latest generating requests that sent one, as
        # vLLM reads it to join the caller's trace (tests check what the router sends).
        self.traceparents: collections.deque[str] = collections.deque(maxlen=1000)

    @property
    def system_fingerprint(self) -> str:
        """What every completion answers as ``system_fingerprint`` (vLLM's ``--fingerprint-mode full``, one GPU)."""
        return self._answer.fingerprint

    def _new_id(self) -> str:
        return f"{next(self._ids):016x}"

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        """Answer one request. Never raises for bad input: that is a 4xx response."""
        if self.api_key is not None and path.startswith(GUARDED_PREFIXES) and method != "OPTIONS":
            if not _bearer_matches(headers.get("authorization"), self.api_key):
                return SimResponse(401, list(JSON_HEADERS), UNAUTHORIZED_BODY)
        given_id = headers.get("x-request-id")
        try:
            route, argument = self._route(method, path)
            response = await self._dispatch(route, argument, headers, body, given_id or self._new_id())
        except RouteError as error:
            response = SimResponse(error.status, [*JSON_HEADERS, *error.headers()], error.body())
        except ApiError as error:
            response = SimResponse.error(error)
        if self.enable_request_id_headers:  # vLLM's XRequestIdMiddleware: on every answer
            response.headers.append(("x-request-id", given_id or f"{next(self._ids):032x}"))
        return response

    async def _dispatch(self, route: str, argument: str | None, headers: Mapping[str, str], body: bytes, request_id: str) -> SimResponse:
        if route in _GENERATING:
            traceparent = headers.get("traceparent")
            if traceparent is not None:
                self.traceparents.append(traceparent)
        if route in ("/v1/chat/completions", "/v1/completions"):
            return await self._completions.complete(route == "/v1/chat/completions", headers, body, request_id)
        if route == "/v1/responses":
            return await self._responses.create(headers, body)
        if route == "/v1/responses/{response_id}":
            assert argument is not None
            return self._responses.retrieve(argument)
        if route == "/v1/responses/{response_id}/cancel":
            assert argument is not None
            return self._responses.cancel(argument)
        if route == "/v1/messages":
            return await self._messages.create(headers, body, request_id)
        if route == "/v1/messages/count_tokens":
            return self._messages.count_tokens(headers, body)
        if route in ("/v1/embeddings", "/pooling"):
            return await self._pooling.embeddings(headers, body, request_id, kind="pooling" if route == "/pooling" else "embedding")
        if route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            return await self._pooling.rerank(headers, body, request_id)
        if route in ("/score", "/v1/score"):
            return await self._pooling.score(headers, body, request_id)
        if route == "/v1/models":
            return SimResponse.json(200, self._models())
        if route in ("/health", "/ping"):
            return SimResponse(200)
        if route == "/version":
            return SimResponse.json(200, {"version": VLLM_VERSION})
        if route == "/tokenize":
            return SimResponse.json(200, tokenize(headers, body, model=self.model, max_model_len=self.engine.params.max_model_len))
        if route == "/detokenize":
            return SimResponse.json(200, detokenize(headers, body, model=self.model))
        return SimResponse(200, [("content-type", self.metrics.content_type)], self.metrics.render())

    def _route(self, method: str, path: str) -> tuple[str, str | None]:
        """FastAPI's routing: the route a path matches (and its ``{response_id}``), else a 404; a method the route does
        not take is a 405 naming those it does."""
        route, argument = path, None
        if path not in self._routes and path.startswith("/v1/responses/"):
            parts = path.split("/")  # "", "v1", "responses", id[, "cancel"]
            if len(parts) == 4 and parts[3]:
                route, argument = "/v1/responses/{response_id}", parts[3]
            elif len(parts) == 5 and parts[3] and parts[4] == "cancel":
                route, argument = "/v1/responses/{response_id}/cancel", parts[3]
        if route not in self._routes:
            raise RouteError(404)
        allowed = self._routes[route]
        if allowed is not None and method not in allowed:
            raise RouteError(405, ", ".join(sorted(allowed)))
        return route, argument

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
