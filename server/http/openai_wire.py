"""OpenAI's and Anthropic's JSON <-> the router's request: translation only, no policy."""

from __future__ import annotations

import json
import sys
from typing import Any

from tailguard.router.admission import MAX_JSON_DEPTH, MAX_TOKENS_FIELD, MESSAGE_KINDS, RequestKind, RouterRequest
from tailguard.router.errors import InvalidRequest

# Fields the router interprets, by kind; every other field passes through to vLLM untouched (a Responses
# request's ``input`` and ``instructions`` and a Messages request's ``system`` too: the router reads them
# for the prompt's size and key, and forwards them as sent).
_ROUTER_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stream"}),
    "completion": frozenset({"model", "prompt", "max_tokens", "stream"}),
    "messages": frozenset({"model", "messages", "max_tokens", "stream"}),
    "responses": frozenset({"model", "max_output_tokens", "stream"}),
    "embeddings": frozenset({"model"}),
    "rerank": frozenset({"model"}),
}
# What each kind must carry: its prompt, and for Anthropic's Messages API its max_tokens (required there).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "completion": ("prompt",),
    "messages": ("messages", "max_tokens"),
    "responses": ("input",),
    "embeddings": ("input",),
    "rerank": ("query", "documents"),
}


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
    for name in _REQUIRED[kind]:
        if payload.get(name) is None:
            raise InvalidRequest(f"{name} is required", param=name)
    if kind == "responses" and not isinstance(payload["input"], (str, list)):
        raise InvalidRequest("input must be a string or a list of input items", param="input")
    if kind == "responses" and payload.get("background") is True:
        # vLLM answers "queued" at once and generates afterwards, outside the seat, the caps and the caller's reach.
        raise InvalidRequest(
            "background responses are not relayed: vLLM would generate them after answering, outside tailguard's seats "
            "and caps; send the request without background (stream it to follow it)",
            param="background",
        )
    stream = payload.get("stream", False) if kind in MAX_TOKENS_FIELD else False  # a pooling answer is one body
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    max_tokens = _max_tokens(kind, payload) if kind in MAX_TOKENS_FIELD else None
    model = payload.get("model")
    owned = _ROUTER_FIELDS[kind]
    params: dict[str, Any] = {k: v for k, v in payload.items() if k not in owned}
    return RouterRequest(
        kind=kind,
        request_id=request_id,
        model=model,
        messages=payload.get("messages") if kind in MESSAGE_KINDS else None,
        prompt=payload.get("prompt") if kind == "completion" else None,
        max_tokens=max_tokens,
        stream=stream,
        params=params,
        caller=caller,
        forced_class=forced_class,
        session=session or None,
    )


def _max_tokens(kind: RequestKind, payload: dict[str, Any]) -> int | None:
    """The output bound as the kind names it (a chat's ``max_completion_tokens`` before its older ``max_tokens``)."""
    key = "max_completion_tokens" if kind == "chat" and payload.get("max_completion_tokens") is not None else MAX_TOKENS_FIELD[kind]
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
