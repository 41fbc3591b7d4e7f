"""tailguard's own backend key, taken out of whatever an engine says before a caller or a log reads it.

An engine (or a proxy in front of it) may quote the request it refused,
``Authorization: Bearer <key>`` included, in an error body or a stream's
error event. That key is tailguard's (a pool's ``api_key_env``), never the
caller's: relayed, it would hand every caller the credential to reach the
engines directly. So every word of an engine that tailguard passes on --
an error's message, type, code and param, a relayed stream's bytes, a quoted
event -- goes through :class:`Redactor` first, at the boundary where it
enters (router/backend/client.py), before any truncation could cut the key in two.

The key is matched as written and as JSON escapes it (a body that quotes
the header inside a JSON string); ``Bearer <key>`` is covered by the key.
"""

from __future__ import annotations

import json

REDACTED = "[redacted]"
_REDACTED_BYTES = REDACTED.encode()


class Redactor:
    """Replaces one secret (a pool's backend key) in text and bytes; a no-op without one."""

    __slots__ = ("_texts", "_bytes")

    def __init__(self, secret: str | None) -> None:
        forms: list[str] = []
        if secret:
            forms.append(secret)
            escaped = json.dumps(secret)[1:-1]  # how the key reads inside a JSON string, if it has to be escaped
            if escaped != secret:
                forms.append(escaped)
        self._texts = tuple(forms)
        self._bytes = tuple(form.encode("utf-8", "surrogatepass") for form in forms)

    def __bool__(self) -> bool:
        """Whether there is a secret to take out (callers skip the work without one)."""
        return bool(self._texts)

    def text(self, value: str) -> str:
        """``value`` with every form of the secret replaced by ``[redacted]``."""
        for form in self._texts:
            if form in value:
                value = value.replace(form, REDACTED)
        return value

    def data(self, value: bytes) -> bytes:
        """``value`` (relayed bytes) with every form of the secret replaced; the same object when it holds none."""
        for form in self._bytes:
            if form in value:
                value = value.replace(form, _REDACTED_BYTES)
        return value
