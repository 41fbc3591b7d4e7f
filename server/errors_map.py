"""Router errors -> HTTP status, OpenAI error body and headers (DESIGN.md's table).

The body is OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so the official SDK raises the matching exception class and
honours ``Retry-After``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

from router import errors

# (HTTP status, error.type, error.code) per router error class; most specific first.
_TABLE: tuple[tuple[type[errors.TailguardError], int, str, str | None], ...] = (
    (errors.PromptTooLong, 413, "invalid_request_error", "context_length_exceeded"),
    (errors.MaxTokensTooLarge, 400, "invalid_request_error", "max_tokens_too_large"),
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (errors.Forbidden, 403, "permission_error", "forbidden"),
    (errors.InvalidRequest, 400, "invalid_request_error", None),
    (errors.QueueFull, 429, "rate_limit_error", "queue_full"),
    (errors.CallerOverLimit, 429, "rate_limit_error", "caller_concurrency_limit"),
    (errors.QueueTimeout, 503, "overloaded", "queue_timeout"),
    (errors.NoBackend, 503, "overloaded", "no_backend"),
    (errors.Draining, 503, "overloaded", "draining"),
    (errors.DeadlineExceeded, 504, "timeout", "deadline_exceeded"),
    (errors.BackendUnavailable, 502, "upstream_error", "upstream_error"),
)


@dataclass(frozen=True)
class HttpError:
    """An error ready to send: status, headers, JSON body."""

    status: int
    body: dict[str, object]
    retry_after: float | None

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(max(1, math.ceil(self.retry_after))).encode()))
        if self.status == 504:
            # The request already used its whole end-to-end budget: an automatic
            # retry (the openai SDK retries 5xx) would double the load of the
            # slowest requests. The SDK obeys this header.
            headers.append((b"x-should-retry", b"false"))
        return headers

    def encoded(self) -> bytes:
        return json.dumps(self.body).encode()

    def sse_event(self) -> bytes:
        """The error as the last event of a stream that already began."""
        return b"data: " + self.encoded() + b"\n\n"


def _body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(error: errors.TailguardError) -> HttpError:
    """The HTTP rendering of a router error."""
    if isinstance(error, errors.BackendRejected):
        error_type = error.error_type or "invalid_request_error"
        return HttpError(error.status, _body(error.message, error_type, error.param, error.code), None)
    for cls, status, error_type, code in _TABLE:
        if isinstance(error, cls):
            retry_after = getattr(error, "retry_after", None)
            return HttpError(status, _body(error.message, error_type, error.param, code), retry_after)
    return HttpError(500, _body(error.message, "internal_error", error.param, None), None)


def invalid(message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> HttpError:
    """A front-end-level rejection (bad JSON, body too large, unknown route)."""
    error_type = "invalid_request_error" if status < 500 else "internal_error"
    return HttpError(status, _body(message, error_type, param, code), None)


# -- gRPC -------------------------------------------------------------------

_GRPC_TABLE: tuple[tuple[type[errors.TailguardError], grpc.StatusCode], ...] = (
    (errors.ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (errors.RequestRejected, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.CallerOverLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Overloaded, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.BackendUnavailable, grpc.StatusCode.UNAVAILABLE),
)

_GRPC_FOR_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True)
class GrpcError:
    """An error ready for ``context.abort``: code, details, trailing metadata."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...]


def grpc_error(error: errors.TailguardError) -> GrpcError:
    """The gRPC rendering of a router error; retry hints go in trailing metadata."""
    if isinstance(error, errors.BackendRejected):
        code = _GRPC_FOR_HTTP.get(error.status, grpc.StatusCode.FAILED_PRECONDITION)
        return GrpcError(code, f"the backend refused the request ({error.status}): {error.message}", ())
    code = next((c for cls, c in _GRPC_TABLE if isinstance(error, cls)), grpc.StatusCode.INTERNAL)
    retry_after = getattr(error, "retry_after", None)
    metadata: tuple[tuple[str, str], ...] = ()
    if retry_after is not None:
        seconds = max(1, math.ceil(retry_after))
        metadata = (("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(int(retry_after * 1000))))
    return GrpcError(code, error.message, metadata)
