"""What every router error means to a caller: the one table both front ends and the docs read.

One row per error class (``router/errors.py`` draws the tree): the request's
outcome and reason (metrics, access log), the HTTP status and OpenAI
``error.type`` / ``code``, Anthropic's ``error.type`` and status (its
routes answer in its shape), the gRPC status *name* (``router/`` never imports
grpc; ``server/errors_map.py`` turns names into ``grpc.StatusCode``), whether
retrying can help, and whether the answer carries a retry hint
(``Retry-After``; gRPC ``retry-after`` and ``grpc-retry-pushback-ms``). A
class without a row of its own takes its nearest ancestor's.

A backend's 4xx (:class:`~router.errors.BackendRejected`) is passed through:
its HTTP status, type and code are the backend's, and its gRPC status follows
the HTTP status (:data:`GRPC_FOR_BACKEND_STATUS`).

Not an error but an ending all the same: a caller that went away is
:data:`CLIENT_CANCELLED` (HTTP 499, as nginx logs it; gRPC CANCELLED); one
that stopped reading until tailguard cut it is :data:`CALLER_STALLED`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import errors

Outcome = Literal["ok", "rejected", "overloaded", "timeout", "cancelled", "backend_error", "internal_error"]


@dataclass(frozen=True)
class ErrorSpec:
    """How one error class is answered, counted and documented."""

    error: type[errors.TailguardError]
    outcome: Outcome
    reason: str  # the metrics' and access log's ``reason``
    http_status: int  # for BackendRejected: the backend's own status replaces it
    error_type: str  # OpenAI ``error.type``
    code: str | None  # OpenAI ``error.code``
    grpc_status: str  # a ``grpc.StatusCode`` name
    retryable: bool  # the same request may succeed later (elsewhere)
    retry_after: bool  # the answer carries the error's ``retry_after`` as a hint
    anthropic_type: str  # Anthropic's ``error.type`` on its routes (/v1/messages)
    anthropic_status: int  # the HTTP status there: Anthropic answers an overloaded service 529


@dataclass(frozen=True)
class Ending:
    """A request's end that is not an error class: the caller left."""

    outcome: Outcome
    reason: str
    http_status: int
    grpc_status: str


CLIENT_CANCELLED = Ending("cancelled", "client_cancelled", 499, "CANCELLED")
# The caller stopped reading and tailguard cut it: a write to it could not complete
# within server.write_timeout. Not a caller who left (499 is nginx's word for that);
# nothing more can reach it, so it is logged, and counted, as the router's own timeout.
CALLER_STALLED = Ending("timeout", "caller_stalled", 408, "DEADLINE_EXCEEDED")


def _row(
    error: type[errors.TailguardError],
    outcome: Outcome,
    reason: str,
    http_status: int,
    error_type: str,
    code: str | None,
    grpc_status: str,
    *,
    retryable: bool = False,
    retry_after: bool = False,
    anthropic: str,
    anthropic_status: int | None = None,
) -> ErrorSpec:
    status = http_status if anthropic_status is None else anthropic_status
    return ErrorSpec(error, outcome, reason, http_status, error_type, code, grpc_status, retryable, retry_after, anthropic, status)


_INVALID = "invalid_request_error"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # also what an engine's own context refusal is given (router/backend/client.py)
_RATE = "rate_limit_error"
_UPSTREAM = "upstream_error"
# Anthropic's error types (its routes answer in its shape: docs/errors in the README's table).
_A_INVALID = "invalid_request_error"
_A_RATE = "rate_limit_error"
_A_OVERLOADED = "overloaded_error"
_A_API = "api_error"

# In the hierarchy's order, which is also the order the docs list them in.
SPECS: tuple[ErrorSpec, ...] = (
    _row(errors.RequestRejected, "rejected", "invalid_request", 400, _INVALID, None, "INVALID_ARGUMENT", anthropic=_A_INVALID),
    _row(errors.InvalidRequest, "rejected", "invalid_request", 400, _INVALID, None, "INVALID_ARGUMENT", anthropic=_A_INVALID),
    _row(errors.PromptTooLong, "rejected", "input_cap", 400, _INVALID, CONTEXT_LENGTH_EXCEEDED, "INVALID_ARGUMENT", anthropic=_A_INVALID),
    _row(errors.MaxTokensTooLarge, "rejected", "max_tokens_cap", 400, _INVALID, "max_tokens_too_large", "INVALID_ARGUMENT", anthropic=_A_INVALID),
    _row(errors.ModelNotFound, "rejected", "model_not_found", 404, _INVALID, "model_not_found", "NOT_FOUND", anthropic="not_found_error"),
    _row(errors.ResponseNotFound, "rejected", "response_not_found", 404, _INVALID, "response_not_found", "NOT_FOUND", anthropic="not_found_error"),
    _row(errors.Unauthenticated, "rejected", "unauthenticated", 401, "authentication_error", "invalid_api_key", "UNAUTHENTICATED", anthropic="authentication_error"),
    _row(errors.Forbidden, "rejected", "forbidden", 403, "permission_error", "forbidden", "PERMISSION_DENIED", anthropic="permission_error"),
    _row(errors.BodyTooLarge, "rejected", "body_too_large", 413, _INVALID, "body_too_large", "RESOURCE_EXHAUSTED", anthropic="request_too_large"),
    _row(errors.Overloaded, "overloaded", "overloaded", 503, "overloaded", "overloaded", "UNAVAILABLE", retryable=True, retry_after=True, anthropic=_A_OVERLOADED, anthropic_status=529),
    _row(errors.QueueFull, "overloaded", "queue_full", 429, _RATE, "queue_full", "RESOURCE_EXHAUSTED", retryable=True, retry_after=True, anthropic=_A_RATE),
    _row(errors.QueueTimeout, "overloaded", "queue_timeout", 503, "overloaded", "queue_timeout", "UNAVAILABLE", retryable=True, retry_after=True, anthropic=_A_OVERLOADED, anthropic_status=529),
    _row(errors.NoBackend, "overloaded", "no_backend", 503, "overloaded", "no_backend", "UNAVAILABLE", retryable=True, retry_after=True, anthropic=_A_OVERLOADED, anthropic_status=529),
    _row(
        errors.CallerOverLimit, "overloaded", "caller_limit", 429, _RATE, "caller_concurrency_limit", "RESOURCE_EXHAUSTED",
        retryable=True, retry_after=True,
        anthropic=_A_RATE,
    ),
    _row(
        errors.BudgetExceeded, "overloaded", "token_budget", 429, _RATE, "token_budget_exceeded", "RESOURCE_EXHAUSTED",
        retryable=True, retry_after=True,
        anthropic=_A_RATE,
    ),
    _row(errors.ServerBusy, "overloaded", "server_busy", 429, _RATE, "server_busy", "RESOURCE_EXHAUSTED", retryable=True, retry_after=True, anthropic=_A_RATE),
    _row(errors.Draining, "overloaded", "draining", 503, "overloaded", "draining", "UNAVAILABLE", retryable=True, retry_after=True, anthropic=_A_OVERLOADED, anthropic_status=529),
    _row(errors.DeadlineExceeded, "timeout", "e2e_timeout", 504, "timeout", "deadline_exceeded", "DEADLINE_EXCEEDED", anthropic="timeout_error"),
    _row(errors.InternalError, "internal_error", "internal_error", 500, "internal_error", "internal_error", "INTERNAL", anthropic=_A_API),
    _row(errors.BackendError, "backend_error", "backend_error", 502, _UPSTREAM, "upstream_error", "UNAVAILABLE", retryable=True, anthropic=_A_API),
    _row(errors.BackendRejected, "rejected", "backend_rejected", 400, _INVALID, None, "INVALID_ARGUMENT", anthropic=_A_INVALID),
    # The operator's key, refused by every endpoint that could take the request: a retry
    # meets the same key (or, once the health check has seen it, a pool with no endpoint).
    _row(errors.BackendAuthFailed, "backend_error", "upstream_auth", 502, _UPSTREAM, "upstream_auth", "UNAVAILABLE", anthropic=_A_API),
    _row(
        errors.BackendUnavailable, "backend_error", "backend_unavailable", 502, _UPSTREAM, "upstream_error", "UNAVAILABLE",
        retryable=True, retry_after=True,
        anthropic=_A_API,
    ),
    _row(
        errors.BackendTimeout, "backend_error", "backend_timeout", 504, _UPSTREAM, "backend_timeout", "UNAVAILABLE",
        retryable=True, retry_after=True,
        anthropic="timeout_error",
    ),
    _row(errors.BackendBusy, "overloaded", "backend_busy", 503, "overloaded", "backend_busy", "UNAVAILABLE", retryable=True, retry_after=True, anthropic=_A_OVERLOADED, anthropic_status=529),
    _row(
        errors.BadBackendReply, "backend_error", "bad_backend_reply", 502, _UPSTREAM, "bad_backend_reply", "UNAVAILABLE",
        retryable=True, retry_after=True,
        anthropic=_A_API,
    ),
    # The backend's own error event already reached an HTTP caller, with its
    # message; a stream cannot carry a retry hint after its head.
    _row(errors.BackendStreamError, "backend_error", "backend_stream_error", 502, _UPSTREAM, "backend_stream_error", "UNAVAILABLE", retryable=True, anthropic=_A_API),
)

# A backend's 4xx, passed through: the gRPC status for its HTTP status (else FAILED_PRECONDITION).
GRPC_FOR_BACKEND_STATUS: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
}

# Bases no code raises as such: their rows are fallbacks for a subclass without one.
BASES: frozenset[type[errors.TailguardError]] = frozenset({errors.RequestRejected, errors.Overloaded, errors.BackendError})

_BY_CLASS: dict[type[errors.TailguardError], ErrorSpec] = {spec.error: spec for spec in SPECS}
_INTERNAL = _BY_CLASS[errors.InternalError]


def spec_for(error: errors.TailguardError) -> ErrorSpec:
    """The row of ``error``'s class, or of its nearest ancestor that has one."""
    spec = _BY_CLASS.get(type(error))
    if spec is not None:
        return spec
    for cls in type(error).__mro__:
        spec = _BY_CLASS.get(cls)
        if spec is not None:
            _BY_CLASS[type(error)] = spec
            return spec
    return _INTERNAL  # a bare TailguardError: nothing documents it, so it is a bug


def http_status(error: errors.TailguardError) -> int:
    """The HTTP status a caller gets (a backend's 4xx passes through as it came)."""
    if isinstance(error, errors.BackendRejected):
        return error.status
    return spec_for(error).http_status


def grpc_status(error: errors.TailguardError) -> str:
    """The gRPC status name a caller gets."""
    if isinstance(error, errors.BackendRejected):
        return GRPC_FOR_BACKEND_STATUS.get(error.status, "FAILED_PRECONDITION")
    return spec_for(error).grpc_status


def openai_type_and_code(error: errors.TailguardError) -> tuple[str, str | None]:
    """OpenAI's ``error.type`` and ``error.code`` (a backend's own when it gave them)."""
    spec = spec_for(error)
    if isinstance(error, errors.BackendRejected):
        return error.error_type or spec.error_type, error.code
    return spec.error_type, spec.code


def anthropic_status_and_type(error: errors.TailguardError) -> tuple[int, str]:
    """The HTTP status and Anthropic ``error.type`` on Anthropic's routes (a backend's 4xx as it came)."""
    spec = spec_for(error)
    if isinstance(error, errors.BackendRejected):
        return error.status, error.error_type or spec.anthropic_type
    return spec.anthropic_status, spec.anthropic_type


def retry_after(error: errors.TailguardError) -> float | None:
    """Seconds to wait before retrying, when the answer carries a hint."""
    if not spec_for(error).retry_after:
        return None
    seconds = getattr(error, "retry_after", None)
    return float(seconds) if isinstance(seconds, (int, float)) else None


def outcome_and_reason(error: errors.TailguardError) -> tuple[Outcome, str]:
    spec = spec_for(error)
    return spec.outcome, spec.reason
