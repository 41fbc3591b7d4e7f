"""A whole completion put together from vLLM's stream, for a caller who asked for a whole answer.

Why: vLLM sends a non-streaming answer only when generation ends, so
nothing tells a long answer from a hung engine before the end-to-end
deadline. Asked as a stream (a pool's ``stream_upstream``), the same
request has a first byte: ``first_byte_timeout`` bounds it, a hung engine
fails fast and is retried elsewhere, and the access log gets a real time
to first token. The events are folded into the body vLLM would have sent:
per choice the content (and ``reasoning_content``), tool calls merged by
their index (ids and names as they come, arguments concatenated), logprobs
appended, the finish and stop reasons; the top-level id, created, model and
the usage of the last event. Every other field the stream carries is kept,
null or not (a field's last non-null value wins). vLLM's whole answer also
carries fields its stream never sends (all null for a text request:
``refusal``, ``service_tier``, ``kv_transfer_params`` ...); when the stream
is vLLM's (its ``system_fingerprint`` says so) they are added as null, so a
client parsing vLLM's whole answer finds every key it knows.

Requests whose non-streaming answer holds what a stream does not
(``prompt_logprobs``, ``echo``, beam search, ``best_of``) are not
assembled: :func:`assemblable` says so and they go to vLLM as asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import BadBackendReply

# Parameters whose whole answer a stream cannot reproduce exactly.
_WHOLE_ONLY = ("prompt_logprobs", "echo", "use_beam_search", "best_of")
# Folded by hand below, not copied as they come.
_FOLDED_TOP = frozenset({"object", "choices", "usage"})
_FOLDED_CHOICE = frozenset({"index", "delta", "text", "logprobs"})
# vLLM's whole answer (0.32, tests/real_vllm checks it) has these fields, null unless asked for, that no stream event has.
_VLLM_FINGERPRINT = "vllm-"
_VLLM_WHOLE_ONLY = {
    "chat": ("service_tier", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"),
    "completion": ("service_tier", "kv_transfer_params", "ec_transfer_params", "metrics"),
}
_VLLM_WHOLE_ONLY_CHOICE = {"chat": ("routed_experts",), "completion": ("prompt_logprobs", "prompt_token_ids", "routed_experts")}
_VLLM_WHOLE_ONLY_MESSAGE = ("refusal", "annotations", "audio", "function_call", "reasoning")
# vLLM's per-request metrics (--enable-per-request-metrics): a stream's usage event drops the nulls, its whole answer keeps them.
_VLLM_METRICS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second", "speculative_decoding")


def assemblable(params: Mapping[str, Any]) -> bool:
    """Whether a stream of this request folds back into exactly its whole answer."""
    if params.get("best_of") not in (None, 1):
        return False
    return not any(params.get(name) for name in _WHOLE_ONLY if name != "best_of")


def sse_objects(chunks: Iterable[bytes]) -> list[dict[str, Any]]:
    """The JSON objects of an SSE byte stream (``[DONE]`` and data-less events left out).

    The relay has checked every event already (``router/backend/client.py``'s
    ``EventFilter``); a payload that is not an object here is still refused.
    """
    parsed: list[dict[str, Any]] = []
    for event in b"".join(chunks).replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            continue
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            raise BadBackendReply("the backend's stream holds an event that is not JSON") from None
        if not isinstance(value, dict):
            raise BadBackendReply("the backend's stream holds an event that is not a JSON object")
        parsed.append(value)
    return parsed


def assemble(kind: str, stream: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The whole answer (``chat.completion`` or ``text_completion``) the events add up to."""
    body: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    tool_calls: dict[int, dict[int, dict[str, Any]]] = {}
    for event in stream:
        _keep(body, event, _FOLDED_TOP)
        if isinstance(event.get("usage"), dict):
            body["usage"] = event["usage"]
        for part in event.get("choices") or ():
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            choice = choices.setdefault(index, _empty_choice(kind, index))
            if kind == "chat":
                _add_delta(choice, part.get("delta") or {}, tool_calls.setdefault(index, {}))
                if isinstance(part.get("logprobs"), dict):
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {"content": []}
                    choice["logprobs"]["content"] += part["logprobs"].get("content") or []
            else:
                choice["text"] += part.get("text") or ""
                if isinstance(part.get("logprobs"), dict):
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    merged = choice["logprobs"]
                    for key in merged:
                        merged[key] += part["logprobs"].get(key) or []
            _keep(choice, part, _FOLDED_CHOICE)
    for index, calls in tool_calls.items():
        if calls:
            choices[index]["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
    body["object"] = "chat.completion" if kind == "chat" else "text_completion"
    body["choices"] = [choices[i] for i in sorted(choices)]
    if str(body.get("system_fingerprint") or "").startswith(_VLLM_FINGERPRINT):
        _add_vllm_whole_only(kind, body)
    return body


def _keep(into: dict[str, Any], part: Mapping[str, Any], folded: frozenset[str]) -> None:
    """Copy ``part``'s fields not folded by hand: the first seen sets a field, a later non-null value replaces it."""
    for key, value in part.items():
        if key not in folded and (value is not None or key not in into):
            into[key] = value


def _add_vllm_whole_only(kind: str, body: dict[str, Any]) -> None:
    """The null fields of vLLM's whole answer that its stream does not carry (see the module's docstring)."""
    for key in _VLLM_WHOLE_ONLY[kind]:
        body.setdefault(key, None)
    for choice in body["choices"]:
        for key in _VLLM_WHOLE_ONLY_CHOICE[kind]:
            choice.setdefault(key, None)
        if kind == "chat":
            for key in _VLLM_WHOLE_ONLY_MESSAGE:
                choice["message"].setdefault(key, None)
    metrics = body.get("metrics")
    if isinstance(metrics, dict):
        for key in _VLLM_METRICS:
            metrics.setdefault(key, None)
    usage = body.get("usage")
    if isinstance(usage, dict):
        usage.setdefault("completion_tokens_details", None)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            details.setdefault("multimodal_tokens", None)


def _empty_choice(kind: str, index: int) -> dict[str, Any]:
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}


def _add_delta(choice: dict[str, Any], delta: Mapping[str, Any], calls: dict[int, dict[str, Any]]) -> None:
    message = choice["message"]
    if delta.get("role"):
        message["role"] = delta["role"]
    for key in ("content", "reasoning_content"):
        text = delta.get(key)
        if isinstance(text, str):
            message[key] = (message.get(key) or "") + text
    for call in delta.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        merged = calls.setdefault(call.get("index", len(calls)), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if call.get("id"):
            merged["id"] = call["id"]
        if call.get("type"):
            merged["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            merged["function"]["name"] = function["name"]
        merged["function"]["arguments"] += function.get("arguments") or ""
