"""Router errors rendered on each wire, from the one table in ``router/error_spec.py``.

HTTP bodies have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so the official SDK raises the matching exception class and
honours ``Retry-After``; on Anthropic's routes (``/v1/messages``) they have
Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, with the
statuses it uses (529 for an overloaded service), so the anthropic SDK
retries what it should. gRPC gets the status the table names, with the same
retry hint in trailing metadata (``retry-after`` seconds and gRPC's own
``grpc-retry-pushback-ms``), and the error's code as ``x-tailguard-error-code``
(``error_code``: the word an HTTP caller reads in ``error.code``), because one
gRPC status stands for several rows (RESOURCE_EXHAUSTED: queue_full,
caller_concurrency_limit, server_busy, body_too_large) and a caller must not
parse the English details to tell them apart. This is the only module that
maps the table's gRPC status names to ``grpc.StatusCode``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

import grpc

from tailguard.router import error_spec, errors
from tailguard.router.queueing import whole_seconds

# Statuses the openai SDK retries on its own unless told not to.
_SDK_RETRIES = frozenset({408, 409, 429})


# Which API's error shape an HTTP route answers in: OpenAI's (every route but Anthropic's), Anthropic's, or
# OpenAI's with the Responses API's stream event (``event: error``).
Dialect = Literal["openai", "anthropic", "responses"]


@dataclass(frozen=True)
class HttpError:
    """An error ready to send: status, headers, JSON body."""

    status: int
    body: dict[str, object]
    retry_after: float | None
    retryable: bool = False
    allow: tuple[str, ...] = ()  # a 405's methods the path does take (its Allow header)
    dialect: Dialect = "openai"

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.allow:
            headers.append((b"allow", ", ".join(self.allow).encode()))
        if self.retry_after is not None:
            headers.append((b"retry-after", str(whole_seconds(self.retry_after)).encode()))
            # The openai SDK reads this first and sleeps it to the millisecond: whole seconds would
            # put every client of a spread hint back on one of two delays.
            headers.append((b"retry-after-ms", str(max(1, math.ceil(self.retry_after * 1000))).encode()))
        if not self.retryable and (self.status >= 500 or self.status in _SDK_RETRIES):
            # E.g. a 504: the request already used its whole end-to-end budget,
            # and an automatic retry (the openai SDK retries 5xx) would double
            # the load of the slowest requests. The SDK obeys this header.
            headers.append((b"x-should-retry", b"false"))
        return headers

    def encoded(self) -> bytes:
        return json.dumps(self.body).encode()

    def sse_event(self) -> bytes:
        """The error as the last event of a stream that already began (Anthropic's names its event)."""
        if self.dialect == "anthropic":
            return b"event: error\ndata: " + self.encoded() + b"\n\n"
        if self.dialect == "responses":
            # The Responses API's error event (type, code, message, param) with OpenAI's error object beside it,
            # which the openai SDK raises as an APIError while iterating, as it does on chat streams.
            error = self.body["error"]
            assert isinstance(error, dict)
            event = {"type": "error", "code": error["code"], "message": error["message"], "param": error["param"], "error": error}
            return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
        return b"data: " + self.encoded() + b"\n\n"


def _body(message: str, error_type: str, param: str | None, code: str | None, dialect: Dialect = "openai") -> dict[str, object]:
    if dialect == "anthropic":  # the anthropic SDK reads error.type and error.message
        return {"type": "error", "error": {"type": error_type, "message": message}}
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(error: errors.TailguardError, dialect: Dialect = "openai") -> HttpError:
    """The HTTP rendering of a router error, in the route's API's shape (the status too: Anthropic's overloaded is 529)."""
    spec = error_spec.spec_for(error)
    if dialect == "anthropic":
        status, error_type = error_spec.anthropic_status_and_type(error)
        body = _body(error.message, error_type, None, None, dialect)
    else:
        error_type, code = error_spec.openai_type_and_code(error)
        status, body = error_spec.http_status(error), _body(error.message, error_type, error.param, code)
    return HttpError(status, body, error_spec.retry_after(error), spec.retryable, dialect=dialect)


def no_route(method: str, path: str, dialect: Dialect = "openai") -> HttpError:
    """404 for a path no route serves, worded and shaped as OpenAI's (or Anthropic's) own answer."""
    error_type = "not_found_error" if dialect == "anthropic" else "invalid_request_error"
    return HttpError(404, _body(f"Invalid URL ({method} {path})", error_type, None, None, dialect), None, dialect=dialect)


def wrong_method(method: str, path: str, allow: tuple[str, ...], dialect: Dialect = "openai") -> HttpError:
    """405 for a known path asked with a method it does not take; ``Allow`` names the ones it does."""
    message = f"Invalid method for URL ({method} {path}): use {' or '.join(allow)}"
    return HttpError(405, _body(message, "invalid_request_error", None, None, dialect), None, allow=allow, dialect=dialect)


# -- gRPC -------------------------------------------------------------------


@dataclass(frozen=True)
class GrpcError:
    """An error ready for ``context.abort``: code, details, trailing metadata."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...]


ERROR_CODE_KEY = "x-tailguard-error-code"


def error_code(error: errors.TailguardError) -> str:
    """The one word both wires give a caller to branch on: OpenAI's ``error.code``, or its
    ``error.type`` where the table has no code (a malformed request: ``invalid_request_error``)."""
    error_type, code = error_spec.openai_type_and_code(error)
    return code or error_type


def grpc_code(name: str) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` the error table names."""
    return grpc.StatusCode[name]


def grpc_error(error: errors.TailguardError) -> GrpcError:
    """The gRPC rendering of a router error; its code and retry hints go in trailing metadata."""
    code = grpc_code(error_spec.grpc_status(error))
    metadata: tuple[tuple[str, str], ...] = ((ERROR_CODE_KEY, error_code(error)),)
    if isinstance(error, errors.BackendRejected):
        return GrpcError(code, f"the backend refused the request ({error.status}): {error.message}", metadata)
    retry_after = error_spec.retry_after(error)
    if retry_after is not None:
        metadata += (
            ("retry-after", str(whole_seconds(retry_after))),
            ("grpc-retry-pushback-ms", str(max(0, math.ceil(retry_after * 1000)))),  # never sooner than told
        )
    return GrpcError(code, error.message, metadata)
