"""The Anthropic Messages API as vLLM 0.32 serves it: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

vLLM reads the request as ``AnthropicMessagesRequest`` (``model``,
``messages`` and ``max_tokens`` required; ``system`` a string or text
blocks; a message's ``content`` a string or blocks) and runs it as a chat
completion: ``system`` becomes one system message, each message's text
blocks are joined, ``max_tokens`` is the chat's ``max_completion_tokens``
(so the renderer names that field when it is over the context). The chat's
errors come back in Anthropic's shape (vLLM's ``translate_error_response``:
``{"type": "error", "error": {"type", "message"}}``, the status kept, the
type vLLM's: "NotFoundError", "BadRequestError", "Service Unavailable");
errors of the request model itself are pydantic's, in vLLM's usual OpenAI
shape ("Bad Request", ``param`` ``body.<field>``).

The answer is ``AnthropicMessagesResponse.model_dump(exclude_none=True)``:
``id`` "chatcmpl-...", one text block, ``stop_reason`` "max_tokens" (the
chat's "length") or "end_turn" ("stop"), ``usage`` ``{"input_tokens",
"output_tokens"}``, and with ``--enable-prompt-tokens-details`` the
prompt's cached tokens apart: ``cache_read_input_tokens`` (hit) and
``cache_creation_input_tokens`` (full blocks cached anew), ``input_tokens``
then the rest. A stream is named events (``event:`` and ``data:`` lines, no
``ping``, no ``[DONE]``): ``message_start`` (usage: the whole prompt as
``input_tokens``, ``output_tokens`` 0), ``content_block_start`` and the first
``content_block_delta`` with the first token, a ``content_block_delta``
(``text_delta``) per engine step, then ``content_block_stop``,
``message_delta`` (``stop_reason``, ``stop_sequence`` null, and the final
usage as the whole answer counts it) and ``message_stop``.

``count_tokens`` answers ``{"input_tokens": N, "context_management":
{"original_input_tokens": N}}``, N the prompt the chat would count; vLLM
renders it as a chat, so the model check, the admission queue (503) and the
renderer's checks apply to it too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .api_errors import ApiError, FieldError, scrub_paths, validation_error
from .generation import Answer, Generation, SequenceStream, cache_written, sse
from .request import CompletionRequest, Fields, chat_prompt, check_model_name, load_json_object, require_json_media
from .sequence import Sequence
from .tokens import detokenize
from .wire import JSON_HEADERS, SimResponse

ROLES = ("user", "assistant", "system")
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system block, which vLLM drops
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
_COMPACT = (",", ":")


def anthropic_error(error: ApiError) -> SimResponse:
    """vLLM's ``translate_error_response``: an error of the chat underneath, in Anthropic's shape, its status kept."""
    body = {"type": "error", "error": {"type": error.kind, "message": scrub_paths(error.message)}}
    return SimResponse(error.status, [*JSON_HEADERS, *error.headers], json.dumps(body).encode())


def parse(content_type: str | None, body: bytes, *, count: bool = False) -> CompletionRequest:
    """The media type, the JSON and pydantic's errors of ``AnthropicMessagesRequest`` (``count``: of
    ``AnthropicCountTokensRequest``, which takes no ``max_tokens``), as the chat vLLM runs."""
    require_json_media(content_type)
    data = load_json_object(body)
    fields = Fields(data)
    model = _model(data, fields)
    contents = _messages(data, fields)
    max_tokens: int | None = None
    if not count:
        max_tokens = fields.integer("max_tokens", None, nullable=False)
        if "max_tokens" not in data:
            fields.errors.append(FieldError("missing", "body.max_tokens", "Field required", data))
        elif max_tokens is not None and max_tokens <= 0:
            _value_error(fields, "max_tokens", "max_tokens must be positive", data["max_tokens"])
    stream = False if count else fields.boolean("stream")
    system = _system(data, fields)
    temperature = fields.number("temperature")
    top_k = fields.integer("top_k", None)
    top_p = fields.number("top_p")
    if fields.errors:
        raise validation_error(fields.errors)
    assert contents is not None
    return CompletionRequest(
        **chat_prompt([*system, *contents]),
        model=model,
        max_tokens=max_tokens,
        max_tokens_param="max_completion_tokens",
        n=1,
        stream=stream,
        include_usage=stream,
        seed=None,
        min_tokens=0,
        ignore_eos=False,
        priority=0,
        cache_salt=data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logprobs=None,
    )


def _value_error(fields: Fields, name: str, text: str, value: object) -> None:
    """A field validator's ``ValueError``, as pydantic reports it."""
    fields.errors.append(FieldError("value_error", f"body.{name}", f"Value error, {text}", value, {"error": ValueError(text)}))


def _model(data: Mapping[str, Any], fields: Fields) -> str | None:
    if "model" not in data:
        fields.errors.append(FieldError("missing", "body.model", "Field required", data))
        return None
    model = fields.text("model")
    if model == "":
        _value_error(fields, "model", "Model is required", model)
    return model


def _messages(data: Mapping[str, Any], fields: Fields) -> list[str] | None:
    """The messages' texts as the chat's messages (a system message's text kept only when there is some)."""
    if "messages" not in data:
        fields.errors.append(FieldError("missing", "body.messages", "Field required", data))
        return None
    messages = data["messages"]
    if not isinstance(messages, list):
        fields.errors.append(FieldError("list_type", "body.messages", "Input should be a valid list", messages))
        return None
    texts: list[str] = []
    for index, message in enumerate(messages):
        where = f"body.messages.{index}"
        if not isinstance(message, dict):
            fields.errors.append(FieldError("model_type", where, "Input should be a valid dictionary or instance of AnthropicMessage", message))
            continue
        role = message.get("role")
        if "role" not in message:
            fields.errors.append(FieldError("missing", f"{where}.role", "Field required", message))
        elif role not in ROLES:
            expected = "'user', 'assistant' or 'system'"
            fields.errors.append(FieldError("literal_error", f"{where}.role", f"Input should be {expected}", role, {"expected": expected}))
        text = _content(message, where, fields)
        if text is not None and (role != "system" or text):
            texts.append(text)
    return texts


def _content(message: Mapping[str, Any], where: str, fields: Fields) -> str | None:
    if "content" not in message:
        fields.errors.append(FieldError("missing", f"{where}.content", "Field required", message))
        return None
    return _blocks_text(message["content"], f"{where}.content", fields)


def _blocks_text(content: object, where: str, fields: Fields, *, system: bool = False) -> str | None:
    """A string, or the text of a list of content blocks: text blocks (and a tool result's text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        fields.errors.append(FieldError("string_type", where, "Input should be a valid string", content))
        fields.errors.append(FieldError("list_type", where, "Input should be a valid list", content))
        return None
    parts: list[str] = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            kind = block.get("type") if isinstance(block, dict) else block
            expected = ", ".join(f"'{name}'" for name in BLOCK_TYPES[:-1]) + f" or '{BLOCK_TYPES[-1]}'"
            fields.errors.append(FieldError("literal_error", f"{where}.list[AnthropicContentBlock].{index}.type", f"Input should be {expected}", kind, {"expected": expected}))
            continue
        text = block.get("text")
        if block["type"] == "text" and isinstance(text, str):
            if not (system and text.startswith(BILLING_HEADER)):
                parts.append(text)
        elif block["type"] == "tool_result":
            result = block.get("content")
            if isinstance(result, str):
                parts.append(result)
            elif isinstance(result, list):
                parts.extend(str(item.get("text", "")) for item in result if isinstance(item, dict))
    return "".join(parts)


def _system(data: Mapping[str, Any], fields: Fields) -> list[str]:
    """``system`` as the chat's one system message (none when it has no text)."""
    system = data.get("system")
    if system is None:
        return []
    text = _blocks_text(system, "body.system", fields, system=True)
    return [text] if text else []


class Messages:
    """One engine's Messages API."""

    def __init__(self, generation: Generation, answer: Answer) -> None:
        self._generation = generation
        self._answer = answer

    async def create(self, headers: Mapping[str, str], body: bytes, request_id: str) -> SimResponse:
        """``POST /v1/messages``: the message whole or streamed; the chat's refusals in Anthropic's shape."""
        request = parse(headers.get("content-type"), body)
        generation = self._generation
        try:
            check_model_name(request.model, self._answer.model)
            generation.admit()
            max_tokens = generation.render(request)
            (sequence,) = generation.submit(request, max_tokens, request_id)
        except ApiError as error:
            return anthropic_error(error)
        message_id = f"chatcmpl-{request_id}"
        if request.stream:
            return SimResponse.sse(MessageStream(generation, sequence, self._answer, message_id))
        await generation.finish([sequence])
        body_out = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": detokenize(sequence.token_ids)}],
            "model": self._answer.model,
            "stop_reason": STOP_REASONS.get(sequence.finish_reason or ""),
            "usage": usage(sequence, self._answer),
        }
        return SimResponse.json(200, body_out)

    def count_tokens(self, headers: Mapping[str, str], body: bytes) -> SimResponse:
        """``POST /v1/messages/count_tokens``: the prompt's tokens, after the chat's model, queue and renderer checks."""
        request = parse(headers.get("content-type"), body, count=True)
        try:
            check_model_name(request.model, self._answer.model)
            self._generation.admit()
            self._generation.render(request)
        except ApiError as error:
            return anthropic_error(error)
        tokens = request.prompt_tokens
        return SimResponse.json(200, {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}})


def usage(sequence: Sequence, answer: Answer) -> dict[str, int]:
    """vLLM's ``_build_anthropic_usage`` of the chat's final usage: with prompt-token details, cache reads and writes
    apart from ``input_tokens`` (writes only where there is a prefix cache)."""
    prompt, output = sequence.prompt_tokens, len(sequence.token_ids)
    if not answer.prompt_tokens_details:
        return {"input_tokens": prompt, "output_tokens": output}
    read = sequence.cached_tokens
    counts = {"input_tokens": prompt - read, "output_tokens": output}
    if answer.cache_block is not None:
        written = cache_written(sequence, answer.cache_block)
        counts["input_tokens"] -= written
        counts["cache_creation_input_tokens"] = written
    counts["input_tokens"] = max(0, counts["input_tokens"])
    counts["cache_read_input_tokens"] = read
    return counts


class MessageStream(SequenceStream):
    """vLLM's Anthropic event stream of one message (the module's docstring lists it)."""

    def __init__(self, generation: Generation, sequence: Sequence, answer: Answer, message_id: str) -> None:
        super().__init__(generation.engine, sequence)
        self._answer = answer
        self._id = message_id

    def tokens(self, token_ids: list[int], position: int) -> bytes:
        out = b""
        if not position:
            message: dict[str, Any] = {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self._answer.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": self.sequence.prompt_tokens, "output_tokens": 0},
            }
            out += _event("message_start", {"type": "message_start", "message": message})
            out += _event("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0})
        delta = {"type": "text_delta", "text": detokenize(token_ids)}
        return out + _event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0})

    def closing(self) -> bytes:
        stop = {"stop_reason": STOP_REASONS.get(self.sequence.finish_reason or ""), "stop_sequence": None}
        out = _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        out += _event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage(self.sequence, self._answer)})
        return out + _event("message_stop", {"type": "message_stop"})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return sse(kind, json.dumps(data, separators=_COMPACT).encode())
