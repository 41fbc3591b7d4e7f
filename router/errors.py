"""Every error the router core raises, named for what the caller should do.

The core knows nothing of HTTP or gRPC. What each class means to a caller --
outcome, reason, HTTP status, OpenAI type/code, gRPC status name, whether to
retry -- is one table, ``router/error_spec.py``; both front ends and the docs
read it (``server/errors_map.py`` renders it on each wire).

    TailguardError
    ├── RequestRejected              the caller must change the request; retrying is useless
    │   ├── InvalidRequest           malformed or out-of-range field
    │   ├── PromptTooLong            estimated prompt over the input cap (or the model's context)
    │   ├── MaxTokensTooLarge        max_tokens over the output cap in "reject" mode
    │   ├── ModelNotFound            no pool serves the requested model
    │   ├── ResponseNotFound         no engine known here keeps the Responses API response asked for
    │   ├── Unauthenticated          missing or unknown API key
    │   ├── Forbidden                the key may not do this (e.g. force a class)
    │   └── BodyTooLarge             the request body is over the front end's byte cap
    ├── Overloaded                   try again later; carries ``retry_after`` seconds
    │   ├── QueueFull                the pool's wait queue is at its bound
    │   ├── QueueTimeout             waited the class's queue deadline without a slot
    │   ├── NoBackend                no healthy endpoint in the pool
    │   ├── CallerOverLimit          the API key has its per-key cap of requests in flight
    │   ├── BudgetExceeded           the API key has used its tokens (or requests) a minute
    │   ├── ServerBusy               the front end has its cap of calls open
    │   └── Draining                 the process is shutting down
    ├── DeadlineExceeded             the request's end-to-end deadline passed
    ├── InternalError                a bug inside the router (logged with its traceback)
    └── BackendError                 the inference server failed the request
        ├── BackendRejected          it answered 4xx: the caller's fault, passed through
        ├── BackendAuthFailed        it answered 401/403 to tailguard's own key: the
        │                            operator's configuration, never the caller's fault
        ├── BackendUnavailable       it answered 5xx or could not be reached
        │   ├── BackendTimeout       no first byte within the pool's first_byte_timeout
        │   └── BackendBusy          it answered 503 before any byte: its own queue is
        │                            full (vLLM --max-num-queued-reqs); not a failure
        ├── BadBackendReply          it answered, but not a valid reply (3xx, not the
        │                            expected JSON/SSE, a stream cut before [DONE],
        │                            a body over its cap, a broken encoding)
        └── BackendStreamError       it reported an error event inside a stream that had
                                     begun (the event was already relayed to the caller)
"""

from __future__ import annotations


class TailguardError(Exception):
    """Base of every error the router raises on purpose.

    ``param`` names the offending request field when there is one, so a
    front end can fill OpenAI's ``error.param``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def log_text(self) -> str:
        """What the logs say of it: the caller's message, and what only the operator may read."""
        return self.message


class RequestRejected(TailguardError):
    """The request itself is wrong; the same request will fail again."""


class InvalidRequest(RequestRejected):
    """A field is missing, of the wrong type, or out of range."""


class PromptTooLong(RequestRejected):
    """The prompt's estimated size is over the input cap or the model's context."""


class MaxTokensTooLarge(RequestRejected):
    """``max_tokens`` is over the output cap and the cap is configured to reject."""


class ModelNotFound(RequestRejected):
    """No pool serves the model the request names."""


class ResponseNotFound(RequestRejected):
    """A stored Responses API response this process does not know the engine of (router/fleet/response_homes.py)."""


class Unauthenticated(RequestRejected):
    """The API key is missing or unknown."""


class Forbidden(RequestRejected):
    """The API key is known but may not do what the request asks."""


class BodyTooLarge(RequestRejected):
    """The request body is over the front end's byte cap; refused before it is read."""


class Overloaded(TailguardError):
    """The request is fine but cannot be served now; retry after ``retry_after`` s."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Overloaded):
    """The pool's wait queue is at its bound; rejected at once."""


class QueueTimeout(Overloaded):
    """The request waited its class's queue deadline without getting a slot."""


class NoBackend(Overloaded):
    """The pool has no healthy endpoint to send the request to."""


class CallerOverLimit(Overloaded):
    """The API key has its per-key concurrency cap of requests in flight."""


class BudgetExceeded(Overloaded):
    """The API key has used its tokens (or requests) a minute; ``retry_after`` is when the window holds the request."""


class ServerBusy(Overloaded):
    """The front end already has its cap of calls open; refused at once, before any work.

    Keeps the process below the load at which it would stop accepting calls
    promptly (grpc core cancels, silently, calls the process is too busy to
    pick up).
    """


class Draining(Overloaded):
    """The process is shutting down and admits no new requests."""


class DeadlineExceeded(TailguardError):
    """The request's end-to-end deadline passed before it finished."""


class BackendError(TailguardError):
    """The inference server failed the request.

    ``message`` goes to the caller: it never names the engine's address
    (an internal URL), and any words of the engine in it went through the
    pool's key redaction (router/backend/redaction.py). ``endpoint`` (the engine's
    URL) and ``detail`` (what the transport said, addresses included) are
    for the logs only: ``log_text`` joins them.
    """

    def __init__(self, message: str, *, param: str | None = None, endpoint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, param=param)
        self.endpoint = endpoint
        self.detail = detail

    @property
    def log_text(self) -> str:
        where = ", ".join(part for part in (self.endpoint, self.detail) if part)
        return f"{self.message} [{where}]" if where else self.message


class BackendRejected(BackendError):
    """The backend answered 4xx: passed through to the caller as it came."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        endpoint: str | None = None,
    ) -> None:
        super().__init__(message, param=param, endpoint=endpoint)
        self.status = status
        self.error_type = error_type
        self.code = code


class BackendUnavailable(BackendError):
    """The backend answered 5xx, broke the connection, or could not be reached.

    Raised before the caller got anything (the router's ``_start_call``), it
    is tried once more on another endpoint; raised from a body already being
    relayed, it ends the answer.
    """

    def __init__(self, message: str, *, retry_after: float = 1.0, endpoint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint, detail=detail)
        self.retry_after = retry_after


class BackendTimeout(BackendUnavailable):
    """The backend sent no first byte within the pool's ``first_byte_timeout``."""


class BackendBusy(BackendUnavailable):
    """The backend answered 503 before any byte: "busy", not "broken".

    vLLM answers so when its own waiting queue is full (``--max-num-queued-reqs``,
    ``--max-num-queued-tokens``). Nothing was generated, so another endpoint
    with a free seat may take the request; it says nothing of the engine's
    health, so outlier detection does not count it. With no sibling to take
    it, the request waits in its pool's queue again, its queue deadline
    unchanged; it reaches the caller only when that deadline passed while
    the engine refused it. ``retry_after`` is the engine's own
    ``Retry-After`` when it sent one (vLLM 0.32 sends none: 1 s).
    """


class BackendAuthFailed(BackendError):
    """The backend refused tailguard's own credentials (401 or 403).

    A caller's key never reaches a backend (tailguard sends the pool's
    ``api_key_env``), so this is the operator's misconfiguration: passing the
    401 through would tell the caller to fix a key that is not theirs. The
    endpoint is taken out until it accepts the key again.
    """

    def __init__(self, message: str, *, status: int = 401, retry_after: float = 1.0, endpoint: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint)
        self.status = status
        self.retry_after = retry_after


class BadBackendReply(BackendError):
    """The backend answered, but its reply is not a valid completion.

    A 3xx, a 2xx that is not the expected JSON or SSE, a stream that ended
    without ``[DONE]`` or a finish reason, a body over its cap, or a body
    whose content encoding does not decode. Answered as 502.
    """

    def __init__(self, message: str, *, retry_after: float = 1.0, endpoint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint, detail=detail)
        self.retry_after = retry_after


class BackendStreamError(BackendError):
    """The backend sent an error event (``data: {"error": ...}``) inside a stream.

    Raised when the stream ends, after every byte of it was relayed: an HTTP
    caller already has the backend's own error event, so the front end adds
    nothing; gRPC ends the call with an error status.
    """


class InternalError(TailguardError):
    """Something failed inside the router that no rule anticipated: a bug.

    Front ends answer 500 (gRPC INTERNAL) and log the traceback once; the
    request's outcome is ``internal_error``.
    """
