"""Translate between protobuf and OpenAI JSON: requests in, completions, stream events and limits out.

Everything unexpected in the backend's JSON is the backend's fault
(BadBackendReply), never an OK with empty content.
"""

from __future__ import annotations

import json
import math
from typing import Any

from google.protobuf import struct_pb2

from tailguard.router.admission import RequestKind, Routing
from tailguard.router.config import Config, limits_of
from tailguard.router.errors import BackendStreamError, BadBackendReply, InvalidRequest

from .gen.tailguard.v1 import tailguard_pb2 as pb

__all__ = ["chunk_message", "embed_fields", "embed_message", "limits_message", "parse_json", "request_fields", "response_message", "routing_message"]

_INT32_MAX = 2**31 - 1
_EXACT_INTEGERS = 2**53  # a double beyond it is no integer to speak of
_FLOAT32_MAX = 3.4028234663852886e38


def routing_message(routing: Routing) -> pb.Routing:
    return pb.Routing(
        request_id=routing.request_id,
        request_class=routing.request_class,
        pool=routing.pool,
        max_tokens=routing.max_tokens,
        max_tokens_clamped=routing.clamped,
        estimated_prompt_tokens=routing.prompt_tokens,
        queue_ms=routing.queue_seconds * 1000,
    )


# -- reading the backend's JSON: anything unexpected is the backend's fault ----------


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit number
        raise BadBackendReply("the backend's reply is not valid JSON") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadBackendReply(f"the backend's reply is not a completion: {what} is not an object")
    return value


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadBackendReply(f"the backend's reply is not a completion: {what} is not a string")
    return value


def _count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
        raise BadBackendReply("the backend's reply is not a completion: a usage count is not a token count")
    return value


def _usage(payload: Any) -> pb.Usage | None:
    if not payload:
        return None
    usage = _object(payload, "usage")
    return pb.Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        total_tokens=_count(usage.get("total_tokens")),
    )


def _first_choice(body: dict[str, Any]) -> dict[str, Any] | None:
    choices = body.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        raise BadBackendReply("the backend's reply is not a completion: choices is not a list")
    return _object(choices[0], "choices[0]") if choices else None


def response_message(kind: RequestKind, payload: Any, routing: Routing) -> pb.CompletionResponse:
    body = _object(payload, "the body")
    if "error" in body:
        raise BadBackendReply(f"the backend answered 200 with an error: {str(body['error'])[:500]}")
    choice = _first_choice(body)
    if choice is None:
        raise BadBackendReply("the backend's reply is not a completion: it has no choices")
    if kind == "chat":
        content = _text(_object(choice.get("message"), "choices[0].message").get("content"), "the message's content")
    else:
        content = _text(choice.get("text"), "choices[0].text")
    finish_reason = _text(choice.get("finish_reason"), "finish_reason")
    if not finish_reason:
        raise BadBackendReply("the backend's reply is not a complete completion: it has no finish reason")
    return pb.CompletionResponse(
        id=_text(body.get("id"), "id"),
        model=_text(body.get("model"), "model"),
        content=content,
        finish_reason=finish_reason,
        usage=_usage(body.get("usage")),
        routing=routing_message(routing),
    )


def chunk_message(kind: RequestKind, payload: Any) -> pb.CompletionChunk:
    """One stream event as protobuf (per relayed event: checks inline, fields set only when present)."""
    event = _object(payload, "a stream event")
    if "error" in event:  # the backend reports a failure inside its stream
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise BackendStreamError(f"the backend failed the stream: {str(message)[:500]}")
    chunk = pb.CompletionChunk()
    choices = event.get("choices")
    if choices:
        choice = choices[0] if type(choices) is list else None
        if type(choice) is not dict:
            raise BadBackendReply("the backend's stream is not a completion: choices[0] is not an object")
        if kind == "chat":
            delta = choice.get("delta")
            if delta is not None and type(delta) is not dict:
                raise BadBackendReply("the backend's stream is not a completion: delta is not an object")
            text = None if delta is None else delta.get("content")
        else:
            text = choice.get("text")
        if text:
            chunk.content = _text(text, "the content")
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            chunk.finish_reason = _text(finish_reason, "finish_reason")
    usage = event.get("usage")
    if usage:
        chunk.usage.CopyFrom(_usage(usage))
    return chunk



def _params(options: pb.Options) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if options.HasField("extra"):
        params.update({key: _value(value, f"options.extra{_step(key)}") for key, value in options.extra.fields.items()})
    for name in ("temperature", "top_p"):
        if options.HasField(name):
            number = getattr(options, name)
            if not math.isfinite(number):  # a float32 field: what was sent past +-3.4e38 arrives as infinity
                where = f"options.{name}"
                raise InvalidRequest(f"{where} is out of range: a float field holds finite numbers up to ±{_FLOAT32_MAX:.4g}", param=where)
            params[name] = number
    for name in ("seed", "n"):
        if options.HasField(name):
            params[name] = getattr(options, name)
    if options.stop:
        params["stop"] = list(options.stop)
    return params


def _value(value: struct_pb2.Value, where: str) -> Any:
    """A ``google.protobuf.Value`` as JSON would carry it; numbers are doubles, and whole ones go to vLLM as integers.

    Only the doubles that are integers exactly (at most 2**53 either way):
    ``1e300`` stays a float, as the same number sent over HTTP does. A
    double JSON cannot carry (infinity, NaN) is the caller's error, named.
    """
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise InvalidRequest(f"{where} is not a finite number", param=where)
        return int(number) if number.is_integer() and abs(number) <= _EXACT_INTEGERS else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {key: _value(item, f"{where}{_step(key)}") for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(item, f"{where}[{index}]") for index, item in enumerate(value.list_value.values)]
    return None  # null_value (or no kind set)


def _step(key: str) -> str:
    """``.key`` for a plain key; anything else as a short escaped string in brackets (it may hold anything)."""
    if key.isascii() and key.isidentifier() and len(key) <= 64:
        return f".{key}"
    return f"[{json.dumps(key[:40])}]"


def request_fields(options: pb.Options, request_id: str) -> dict[str, Any]:
    """The RouterRequest fields an Options message gives; InvalidRequest for ``n`` > 1.

    A response and a stream chunk carry one choice (``content``), so a call
    that asked vLLM for n choices would be charged n sequences and get one,
    its stream's choices interleaved: refused, naming the field.
    """
    params = _params(options)
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise InvalidRequest(
            f"the gRPC API answers one choice a call, and n = {n} asks for more: send n calls (or use the HTTP API's n)",
            param="options.n" if options.HasField("n") else "options.extra.n",
        )
    return {
        "request_id": request_id,
        "max_tokens": options.max_tokens if options.HasField("max_tokens") else None,
        "params": params,
        "forced_class": options.request_class or None,
    }



def embed_fields(message: pb.EmbedRequest, request_id: str) -> dict[str, Any]:
    """The RouterRequest fields of an Embed call: its texts as vLLM's ``input``, as floats (the reply's vectors)."""
    params: dict[str, Any] = {}
    if message.HasField("extra"):
        params.update({key: _value(value, f"extra{_step(key)}") for key, value in message.extra.fields.items()})
    params["input"] = list(message.input)
    params["encoding_format"] = "float"
    return {"request_id": request_id, "params": params, "forced_class": message.request_class or None, "model": message.model or None}


def embed_message(payload: Any, routing: Routing) -> pb.EmbedResponse:
    """vLLM's embeddings answer as protobuf; anything else is the backend's fault."""
    body = _object(payload, "the body")
    data = body.get("data")
    if not isinstance(data, list):
        raise BadBackendReply("the backend's reply is not embeddings: data is not a list")
    embeddings = []
    for position, item in enumerate(data):
        entry = _object(item, f"data[{position}]")
        vector = entry.get("embedding")
        if not isinstance(vector, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector):
            raise BadBackendReply(f"the backend's reply is not embeddings: data[{position}].embedding is not a list of numbers")
        index = entry.get("index", position)
        embeddings.append(pb.Embedding(index=_count(index), embedding=vector))
    return pb.EmbedResponse(model=_text(body.get("model"), "model"), data=embeddings, usage=_usage(body.get("usage")), routing=routing_message(routing))


def limits_message(config: Config) -> pb.Limits:
    """The limits in force, as protobuf: the record HTTP's /v1/limits serves as JSON."""
    limits = limits_of(config)
    estimate = limits.estimate
    return pb.Limits(
        input_cap_tokens=limits.input_cap_tokens,
        default_max_tokens=limits.default_max_tokens,
        output_cap_tokens=limits.output_cap_tokens,
        over_cap=limits.over_cap,
        estimate=pb.EstimateRule(
            chars_per_token=estimate.chars_per_token,
            cjk_chars_per_token=estimate.cjk_chars_per_token,
            per_message_tokens=estimate.per_message_tokens,
            learn=estimate.learn,
        ),
        end_to_end_timeout_s=limits.end_to_end_timeout,
        classes=[
            pb.ClassLimits(
                name=c.name,
                max_prompt_tokens=c.max_prompt_tokens,
                max_output_tokens=c.max_output_tokens,
                queue_timeout_s=c.queue_timeout,
                priority=c.priority,
                pool=c.pool,
                objective=pb.Objective(
                    ttft_s=c.objective.ttft,
                    itl_s=c.objective.itl,
                    e2e_s=c.objective.e2e,
                    percentile=c.objective.percentile,
                    throughput_share=c.objective.throughput_share,
                ),
            )
            for c in limits.classes
        ],
        pools=[pb.PoolLimits(name=p.name, max_model_len=p.max_model_len, models=list(p.models)) for p in limits.pools],
    )

