"""vLLM 0.32's error bodies, in its three shapes: its own errors, pydantic's validation list, and FastAPI's bare ``detail``.

vLLM answers a request it refuses in one of three ways, and a router that
reads error bodies meets all three:

- its own errors (``VLLMValidationError`` and friends, through
  ``create_error_response`` in vllm/entrypoints/serve/exception_handling/):
  ``{"error": {"message", "type", "param", "code"}}`` with ``type``
  "BadRequestError", "NotFoundError", ...; a validation error's message
  ends with " (parameter=P, value=V)" when it names them;
- pydantic's validation errors (a wrong JSON type, a missing body), through
  its ``RequestValidationError`` handler: the same envelope, ``type`` "Bad
  Request", the message "N validation error(s):" and one line per error
  (``{'type': ..., 'loc': 'body.field', 'msg': ..., 'input': ...}``), and
  ``param`` the first error's dotted location;
- FastAPI's own answers for routing (Starlette's 404 and 405):
  ``{"detail": "Not Found"}``, ``{"detail": "Method Not Allowed"}`` with an
  ``Allow`` header.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

_MAX_REPORTED_ERRORS = 10  # vLLM's validation handler reports at most this many
# vLLM scrubs every error message of file paths before it answers (``sanitize_message``):
# a path under a system root, or any path that ends in a file name with an extension.
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")
_MAX_INPUT_CHARS = 200  # and cuts each error's echoed input at this length


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
        self.kind = kind if kind is not None else _ERROR_TYPES.get(status, HTTPStatus(status).phrase)
        self.headers = headers

    def body(self) -> bytes:
        message = scrub_paths(self.message)
        return json.dumps({"error": {"message": message, "type": self.kind, "param": self.param, "code": self.status}}).encode()


def scrub_paths(message: str) -> str:
    """A message as vLLM answers it: file paths (a model served from ``/models/x``, say) read ``<path>``."""
    if "/" not in message:
        return message
    return _FILE_PATH.sub("<path>", _SYSTEM_PATH.sub("<path>", message)).strip()


# ``create_error_response``'s types by status, for vLLM's own errors.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLarge",
    500: "InternalServerError",
}


class RouteError(Exception):
    """FastAPI's answer for a path it has no route for (404) or a method the path does not take (405)."""

    def __init__(self, status: int, allow: str | None = None) -> None:
        super().__init__(HTTPStatus(status).phrase)
        self.status = status
        self.allow = allow

    def body(self) -> bytes:
        return json.dumps({"detail": HTTPStatus(self.status).phrase}).encode()

    def headers(self) -> tuple[tuple[str, str], ...]:
        return () if self.allow is None else (("allow", self.allow),)


def vllm_error(message: str, *, param: str | None = None, value: object = None, report_param: bool = True) -> ApiError:
    """A ``VLLMValidationError``'s 400: the message with vLLM's " (parameter=P, value=V)" suffix.

    ``report_param=False`` keeps the suffix out of ``param``: a few checks
    (``SamplingParams``' ranges of n, penalties, top_k) name no parameter,
    so vLLM answers ``param: null`` and no suffix.
    """
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(400, text, param=param if report_param else None)


@dataclass(frozen=True)
class FieldError:
    """One of pydantic's validation errors: its type, where (dotted, under ``body``), its message and the input."""

    kind: str
    loc: str
    msg: str
    value: object
    ctx: dict[str, object] | None = None

    def line(self) -> str:
        """As vLLM's handler prints it: the error dict's ``str``, the input summarized."""
        entry: dict[str, object] = {"type": self.kind, "loc": self.loc, "msg": self.msg, "input": summarize_input(self.value)}
        if self.ctx is not None:
            entry["ctx"] = self.ctx
        return str(entry)


def summarize_input(value: object) -> str:
    """vLLM's bounded stand-in for an error's input: text cut at 200 characters, a container by its size."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_INPUT_CHARS else value[:_MAX_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def validation_error(errors: Sequence[FieldError]) -> ApiError:
    """pydantic's errors as vLLM's ``RequestValidationError`` handler answers them: 400 "Bad Request", ``param`` the first's location."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n" + "".join(f"  {error.line()}\n" for error in reported)
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    return ApiError(400, message.rstrip(), param=errors[0].loc if errors else None, kind="Bad Request")


def bare_validation_error(text: str) -> ApiError:
    """A validation error that is a plain string (vLLM's media-type check raises one): no location, no ``param``."""
    return ApiError(400, f"1 validation error:\n  {text}", kind="Bad Request")
