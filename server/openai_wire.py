"""OpenAI JSON <-> the router's request: translation only, no policy."""

from __future__ import annotations

import json
from typing import Any

from router.errors import InvalidRequest
from router.request import RequestKind, RouterRequest

# Fields the router interprets; every other field passes through to vLLM untouched.
_ROUTER_FIELDS = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream"})


def parse_completion_body(
    kind: RequestKind,
    body: bytes,
    *,
    request_id: str,
    forced_class: str | None = None,
    caller: str | None = None,
) -> RouterRequest:
    """Build a RouterRequest from an OpenAI request body; InvalidRequest if it is not one."""
    try:
        payload = json.loads(body)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from None
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
    )


def _max_tokens(kind: RequestKind, payload: dict[str, Any]) -> int | None:
    key = "max_completion_tokens" if kind == "chat" and payload.get("max_completion_tokens") is not None else "max_tokens"
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer, got {json.dumps(value)[:40]}", param=key)
    return value
