"""OpenAI JSON <-> the router's request: translation only, no policy."""

from __future__ import annotations

import json
import sys
from typing import Any

from tailguard.router.admission import MAX_JSON_DEPTH, RequestKind, RouterRequest
from tailguard.router.errors import InvalidRequest

# Fields the router interprets; every other field passes through to vLLM untouched.
_ROUTER_FIELDS = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream"})


def parse_completion_body(
    kind: RequestKind,
    body: bytes,
    *,
    request_id: str,
    forced_class: str | None = None,
    caller: str | None = None,
    session: str | None = None,
) -> RouterRequest:
    """Build a RouterRequest from an OpenAI request body; InvalidRequest if it is not one.

    Whatever the body holds, the answer is a RouterRequest or InvalidRequest:
    a number with thousands of digits (ValueError from ``int()``) and nesting
    past the parser's recursion limit (RecursionError) are the caller's fault,
    not a 500. RouterRequest then refuses what could not be forwarded as
    valid JSON (lone surrogates, NaN, deep nesting), naming the field.
    """
    try:
        payload = json.loads(body)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from None
    except ValueError:
        # The only other ValueError json raises: an integer over the interpreter's digit limit.
        raise InvalidRequest(
            f"the request body holds an integer with more than {sys.get_int_max_str_digits()} digits"
        ) from None
    except RecursionError:
        raise InvalidRequest(
            f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels of objects and lists)"
        ) from None
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if kind == "chat" and "messages" not in payload:
        raise InvalidRequest("messages is required", param="messages")
    if kind == "completion" and "prompt" not in payload:
        raise InvalidRequest("prompt is required", param="prompt")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    max_tokens = _max_tokens(kind, payload)
    model = payload.get("model")
    params: dict[str, Any] = {k: v for k, v in payload.items() if k not in _ROUTER_FIELDS}
    return RouterRequest(
        kind=kind,
        request_id=request_id,
        model=model,
        messages=payload.get("messages") if kind == "chat" else None,
        prompt=payload.get("prompt") if kind == "completion" else None,
        max_tokens=max_tokens,
        stream=stream,
        params=params,
        caller=caller,
        forced_class=forced_class,
        session=session or None,
    )


def _max_tokens(kind: RequestKind, payload: dict[str, Any]) -> int | None:
    key = "max_completion_tokens" if kind == "chat" and payload.get("max_completion_tokens") is not None else "max_tokens"
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer, got {_describe(value)}", param=key)
    return value


def _describe(value: object) -> str:
    """A short, safe picture of a wrong value for an error message (never the
    whole value: it may be nested hundreds deep or hold a lone surrogate)."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    return json.dumps(value)[:40]
