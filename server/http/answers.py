"""The answers the HTTP server writes itself: status lines, and errors in OpenAI's shape that close the connection."""

from __future__ import annotations

import http

from ..errors_map import HttpError

_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus}


def status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


def error_bytes(status: int, message: str, code: str | None) -> bytes:
    """A complete answer that closes the connection, in OpenAI's error shape."""
    error_type = "overloaded" if status == 503 else "internal_error" if status == 500 else "invalid_request_error"
    error = HttpError(status, {"error": {"message": message, "type": error_type, "param": None, "code": code}}, None)
    body = error.encoded()
    headers = [*error.headers(), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    return status_line(status) + b"".join(b"%s: %s\r\n" % header for header in headers) + b"\r\n" + body


TOO_MANY = error_bytes(503, "too many open connections; retry shortly", "too_many_connections")
NOT_TLS = error_bytes(400, "this port speaks TLS: use https://", "tls_required")
