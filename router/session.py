"""One request's life around :meth:`Router.open`, the same for both front ends.

A front end translates its wire request and answer; everything else a
completion request goes through is here, once::

    session = sessions.start(supplied_id)                  # id check and repeat count, record
    async with session:                                    # refused id, cap on open calls
        caller = session.authenticate(authorization)       # Unauthenticated
        request = <parse the wire request>                 # may raise a TailguardError
        async with session.completion(request, caller) as completion:   # deadline scope, router
            <relay completion to the wire>

Leaving ``async with session`` finishes the request's telemetry record exactly
once, with the outcome the caller got:

- normally: ``ok`` -- or ``cancelled`` if the front end reported with
  :meth:`Session.left` that the caller went away;
- with a :class:`~router.errors.TailguardError`: its row in
  ``router/error_spec.py``; the error is re-raised for the front end to render;
- cancelled from outside (a gRPC caller's cancel, shutdown): ``cancelled``;
- with anything else: a bug. It is logged here, once, with its traceback,
  recorded as ``internal_error``, and re-raised as
  :class:`~router.errors.InternalError`, which the front end renders like any
  other error (HTTP 500 in OpenAI's shape, gRPC INTERNAL).

The end-to-end deadline is a cancel scope around the router call; when it
passes, :meth:`Session.completion` raises DeadlineExceeded. Nothing here
runs per relayed chunk.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from .admission import RouterRequest, Routing
from .dispatch import Completion, Router
from .error_spec import CALLER_STALLED, CLIENT_CANCELLED
from .errors import DeadlineExceeded, InternalError, InvalidRequest, ServerBusy, TailguardError
from .ids import IdSource
from .observe import Api, RepeatedIds, RequestRecord, Telemetry, is_valid_request_id
from .quotas import Caller

if TYPE_CHECKING:  # imported only while [tracing] is on
    from .observe.tracing import Tracing

__all__ = ["ClientLeft", "Session", "Sessions", "checked_header", "checked_headers"]

log = logging.getLogger("tailguard.session")

# Header and metadata values the router emits: printable ASCII and spaces only.
# A control character would end the header line (or be refused by grpc).
_UNSAFE = re.compile(r"[^\x20-\x7e]")


class ClientLeft(Exception):
    """The front end saw its caller go away: there is no one left to answer.

    Raised inside a session (by the front end, or by :meth:`Session.completion`
    after :meth:`Session.left`); the session records ``cancelled`` and swallows it.
    """


def checked_header(name: str, value: str) -> str:
    """``value`` if it is safe in a header or gRPC metadata; else InternalError (a bug)."""
    if _UNSAFE.search(value) is not None:
        raise InternalError(f"refusing to emit the {name} header: its value holds a control or non-ASCII character")
    return value


def checked_headers(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((name, checked_header(name, value)) for name, value in pairs)


class Sessions:
    """What one front end shares across its requests: the router, telemetry, id memory, a cap.

    ``max_open`` bounds the sessions open at once: beyond it a request gets
    :class:`~router.errors.ServerBusy` (with a retry hint) before any work, and
    is still recorded. ``request_id_field`` names where the wire carries the id
    (for the error's ``param``). ``tracing`` says, per request, which tracer
    (if any: None while ``[tracing]`` is off) traces it.
    """

    def __init__(
        self,
        router: Router,
        telemetry: Telemetry,
        api: Api,
        *,
        repeated_ids: RepeatedIds | None = None,
        on_repeat: Callable[[], None] | None = None,
        max_open: int | None = None,
        log_prompts: Callable[[], bool] | None = None,
        request_id_field: str = "x-request-id",
        tracing: Callable[[], Tracing | None] | None = None,
    ) -> None:
        self.router = router
        self.telemetry = telemetry
        self.api: Api = api
        self.max_open = max_open
        self._repeated_ids = repeated_ids
        self._on_repeat = on_repeat
        self._log_prompts = log_prompts
        self._request_id_field = request_id_field
        self._tracing = tracing
        self._open = 0
        self._ids = IdSource()  # the ids of requests whose caller sent none (router/ids.py)

    @property
    def open_count(self) -> int:
        return self._open

    def request_id(self, supplied: str | None) -> tuple[str, InvalidRequest | None]:
        """The id a request goes by, and why the caller's own was refused, if it was.

        A valid caller-supplied id seen again within the window counts as a
        repeat (a client retrying). An invalid one is replaced by a fresh id,
        so that nothing the caller sent reaches a header or a log line.
        """
        if not supplied:
            return self._ids.fresh(), None
        if not is_valid_request_id(supplied):
            message = f"{self._request_id_field} must be 1 to 128 printable ASCII characters without spaces"
            return self._ids.fresh(), InvalidRequest(message, param=self._request_id_field)
        if self._repeated_ids is not None and self._repeated_ids.observe(supplied) and self._on_repeat is not None:
            self._on_repeat()
        return supplied, None



    def start(self, supplied_id: str | None = None, *, carrier: Mapping[str, str] | None = None, route: str = "") -> Session:
        """A session for one completion request; enter it with ``async with``.

        Nothing is raised here, so the front end knows the request id it
        answers under whatever happens next; a refused id is raised on entry.
        While tracing is on the request is traced from here: ``carrier`` (the
        caller's headers or metadata, lower-case names) may hold its parent's
        ``traceparent``, and ``route`` names its span.
        """
        request_id, refused = self.request_id(supplied_id)
        record = self.telemetry.start(request_id, self.api)
        if self._tracing is not None:
            tracing = self._tracing()
            if tracing is not None:
                record.trace = tracing.start(record, carrier, route)
        return Session(self, record, refused)

    def _busy(self) -> ServerBusy | None:
        if self.max_open is None or self._open < self.max_open:
            return None
        retry_after = self.router.config.timeouts.retry_after
        return ServerBusy(
            f"tailguard has {self.max_open} {self.api} calls open, its cap; retry after {retry_after:g} s",
            retry_after=retry_after,
        )

    def _settle(self, session: Session, exc: BaseException) -> BaseException | None:
        """Finish the record for ``exc``; return what to raise (None: nothing)."""
        if isinstance(exc, ClientLeft):
            self._finish(session, None, client_gone=True)
            return None
        if isinstance(exc, TailguardError):
            self._finish(session, exc)
            return exc
        leaves = list(_leaves(exc))
        errors = [leaf for leaf in leaves if not isinstance(leaf, (trio.Cancelled, ClientLeft))]
        if not errors or any(not isinstance(leaf, Exception) for leaf in errors):
            # Cancelled from outside (the caller went, or shutdown), or KeyboardInterrupt and its kin.
            self._finish(session, None, client_gone=True)
            return exc if any(not isinstance(leaf, ClientLeft) for leaf in leaves) else None
        if len(errors) == 1 and isinstance(errors[0], TailguardError):  # wrapped by a nursery on its way out
            self._finish(session, errors[0])
            return errors[0]
        log.error(
            "request %s failed unexpectedly: %s", session.request_id, type(exc).__name__, exc_info=exc,
            extra={"fields": {"request_id": session.request_id}},
        )
        internal = InternalError(
            f"tailguard failed unexpectedly ({type(exc).__name__}); the error is logged under request id {session.request_id}"
        )
        self._finish(session, internal)
        return internal

    def _finish(self, session: Session, error: TailguardError | None, *, client_gone: bool = False) -> None:
        record = session.record
        # A front end that sent a response head set the status the caller saw;
        # otherwise the error table says what it is (or will be) answered with.
        status = None if client_gone else record.status
        ending = CALLER_STALLED if session.stalled else CLIENT_CANCELLED
        self.telemetry.finish(record, error, status=status, client_gone=client_gone, ending=ending)


def _leaves(exc: BaseException) -> Iterable[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


class Session:
    """One request in progress: its record, caller, deadline scope; made by :meth:`Sessions.start`.

    ``async with session:`` is the request's whole life; leaving it finishes
    the record (see the module's docstring).
    """

    __slots__ = ("_owner", "record", "client_gone", "stalled", "_left_at", "_scope", "_refused")

    def __init__(self, owner: Sessions, record: RequestRecord, refused: TailguardError | None = None) -> None:
        self._owner = owner
        self.record = record
        self.client_gone = False
        self.stalled = False  # gone because it stopped reading and a write to it timed out (tailguard cut it)
        self._left_at = float("inf")  # when the front end said the caller went (``left``)
        self._scope: trio.CancelScope | None = None
        self._refused = refused

    async def __aenter__(self) -> Session:
        owner = self._owner
        refused = self._refused or owner._busy()
        if refused is not None:
            owner._finish(self, refused)
            raise refused
        owner._open += 1
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        owner = self._owner
        owner._open -= 1
        if exc is None:
            owner._finish(self, None, client_gone=self.client_gone)
            return False
        answered = owner._settle(self, exc)
        if answered is None:
            return True
        if answered is not exc:
            raise answered from exc
        return False

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` value names; raises Unauthenticated."""
        caller = self._owner.router.authenticate(authorization)
        self.record.caller = caller.name
        return caller

    def left(self, *, stalled: bool = False) -> None:
        """The front end saw the caller go away: stop the request (the backend's generation with it).

        ``stalled``: it did not leave, it stopped reading, and the front end cut
        it when a write could not complete (logged as the router's timeout, not a 499).
        """
        if not self.client_gone:
            self.stalled = stalled
            self._left_at = trio.current_time()
        self.client_gone = True
        if self._scope is not None:
            self._scope.cancel()

    @asynccontextmanager
    async def completion(self, request: RouterRequest, caller: Caller) -> AsyncIterator[Completion]:
        """The router's completion inside the request's end-to-end deadline.

        Raises what :meth:`Router.open` raises; DeadlineExceeded when the
        deadline passes before the body is done; ClientLeft after :meth:`left`.
        """
        record = self.record
        router = self._owner.router
        if self._owner._log_prompts is not None and self._owner._log_prompts():
            record.prompt_text = "\n".join(request.texts())
        done = False
        with trio.CancelScope(deadline=router.deadline_for(request, record.arrival)) as scope:
            self._scope = scope
            if self.client_gone:
                scope.cancel()
            try:
                async with router.open(request, arrival=record.arrival, caller=caller, record=record) as completion:
                    yield completion
                    done = True
            finally:
                self._scope = None
        if scope.cancelled_caught and not done:
            # The deadline cut the request, whatever the front end says after: a write it cancelled
            # (to a caller that was not reading) reports the connection cut -- tailguard's own doing.
            if self.client_gone and self._left_at < scope.deadline:
                raise ClientLeft
            raise DeadlineExceeded("the request did not finish within its end-to-end deadline")

    def routing_facts(self, routing: Routing) -> tuple[tuple[str, str], ...]:
        """What the router decided, as header / metadata pairs (both wires send the same)."""
        return checked_headers(
            (
                ("x-request-id", self.record.request_id),
                ("x-tailguard-class", routing.request_class),
                ("x-tailguard-pool", routing.pool),
                ("x-tailguard-max-tokens", str(routing.max_tokens)),
                ("x-tailguard-queue-ms", f"{routing.queue_seconds * 1000:.1f}"),
                *self.record.rate_limits,
            )
        )
