"""The OpenAI Responses API as vLLM 0.32 serves it: ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A request is a chat to the engine: ``instructions`` as a system message, then
``input`` (a string: one user message; or a list of message items, their
content a string or parts with ``text``), ``max_output_tokens`` as its
``max_tokens`` (none: the context left). It takes vLLM's steps in vLLM's
order (``_create_responses`` in vllm/entrypoints/openai/responses/serving.py):
the request model's validators and types, the model (404), ``background``
without a store (400), the admission queue (503), ``previous_response_id``
(404 unless stored), the renderer, a prompt that fills the context ("The
engine prompt length ...", 400), ``SamplingParams``.

The answer is vLLM's ``ResponsesResponse`` (``id`` "resp_...", ``object``
"response", ``status`` "completed", or "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when the output reached
``max_output_tokens``; one message item with one ``output_text`` part;
``usage`` with its details, ``cache_write_tokens`` the prompt's blocks the
request cached anew). A stream is vLLM's named events (``event:`` and
``data:`` lines, each with its ``sequence_number``): ``response.created`` and
``response.in_progress`` at once, then with the first token
``response.output_item.added`` and ``response.content_part.added``, a
``response.output_text.delta`` per engine step, and after the last token
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (the whole response,
usage included: the only event that counts tokens). No ``[DONE]``.

vLLM keeps responses only when started with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``store=True`` here); without it
``store`` is ignored, nothing is ever found (``GET``, ``cancel`` and
``previous_response_id`` answer 404) and ``background`` is refused. With it,
a response asked ``store`` (the default) is kept once it has ended, a later
one may continue it (``previous_response_id``: its conversation and output
come before the new input), and ``background`` answers at once with status
"queued" while the engine runs it (streamed, its events as any stream's, and
a reader that leaves does not stop it); ``cancel`` aborts a queued one and
refuses one that ended ("Cannot cancel a synchronous response."). ``GET``
returns the response as kept ("queued" until its sequence ends, as vLLM
keeps it); its ``stream=true`` replay of a background stream is not served.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .api_errors import ApiError, FieldError, validation_error, vllm_error
from .generation import Answer, Generation, SequenceStream, cache_written, sse, whole_timing
from .logprobs import responses_logprobs
from .request import CompletionRequest, Fields, chat_prompt, check_cache_salt, check_model_name, load_json_object, require_json_media
from .sequence import Sequence
from .tokens import detokenize
from .wire import SimResponse

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for the output's logprobs
STORE_OFF_MESSAGE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable "
    "these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)
_COMPACT = (",", ":")


@dataclass(frozen=True)
class ResponsesRequest:
    """What the engine and the answer need of a Responses request that passed vLLM's validation."""

    model: str | None
    instructions: str | None
    inputs: tuple[str, ...]  # the input's message texts
    request_id: str | None  # vLLM's extra field: the response's id
    store: bool
    background: bool
    stream: bool
    previous_response_id: str | None
    max_output_tokens: int | None
    logprobs: int | None  # top_logprobs, when ``include`` asks for the output's logprobs
    sampling: Mapping[str, Any]  # the engine's fields of a CompletionRequest, but the prompt's
    echo: Mapping[str, Any]  # the request's fields the response repeats as they came

    def completion(self, history: list[str]) -> CompletionRequest:
        """The chat the engine runs: the instructions, ``history`` (a previous response's turn), then the input."""
        system = [self.instructions] if self.instructions is not None else []
        return CompletionRequest(**chat_prompt([*system, *history, *self.inputs]), **self.sampling)


def parse(content_type: str | None, body: bytes) -> ResponsesRequest:
    """The media type, the JSON, ``ResponsesRequest``'s "before" validators (last defined first), then its field types."""
    require_json_media(content_type)
    data = load_json_object(body)
    _before_validators(data)
    tools = data.get("tools") or []
    if not tools and data.get("tool_choice", "auto") in ("auto", "none"):  # check_tool_usage: no tools, no choice
        data = {**data, "tool_choice": "none"}
    fields = Fields(data)
    background = fields.boolean("background")
    include = data.get("include")
    inputs = _input(data, fields)
    instructions = fields.text("instructions")
    max_output_tokens = fields.integer("max_output_tokens", None)
    fields.integer("max_tool_calls", None)
    model = fields.text("model")
    parallel = data.get("parallel_tool_calls", True)
    previous = fields.text("previous_response_id")
    store = fields.boolean("store") if "store" in data else True
    stream = fields.boolean("stream")
    temperature = fields.number("temperature")
    top_logprobs = fields.integer("top_logprobs", 0)
    top_p = fields.number("top_p")
    top_k = fields.integer("top_k", None)
    min_p = fields.number("min_p")
    fields.text("user")
    presence = fields.number("presence_penalty")
    frequency = fields.number("frequency_penalty")
    request_id = fields.text("request_id")
    priority = fields.integer("priority", 0, nullable=False, bounded=True)
    salt = fields.text("cache_salt")
    repetition = fields.number("repetition_penalty")
    seed = fields.integer("seed", None, bounded=True)
    ignore_eos = fields.boolean("ignore_eos", nullable=False)
    if fields.errors:
        raise validation_error(fields.errors)
    assert inputs is not None
    wants_logprobs = isinstance(include, list) and OUTPUT_LOGPROBS in include
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    tool_choice = data.get("tool_choice", "auto")
    sampling = {
        "model": model,
        "max_tokens": max_output_tokens,
        "max_tokens_param": "max_output_tokens",
        "n": 1,
        "stream": stream,
        "include_usage": False,
        "seed": seed,
        "min_tokens": 0,
        "ignore_eos": ignore_eos,
        "priority": priority or 0,
        "cache_salt": salt,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": top_k or 0,
        "min_p": 0.0 if min_p is None else min_p,
        "presence_penalty": 0.0 if presence is None else presence,
        "frequency_penalty": 0.0 if frequency is None else frequency,
        "repetition_penalty": 1.0 if repetition is None else repetition,
        "logprobs": logprobs,
    }
    echo = {
        "metadata": data.get("metadata"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "tool_choice": tool_choice,
        "tools": tools,
        "max_tool_calls": data.get("max_tool_calls"),
        "reasoning": data.get("reasoning"),
        "service_tier": data.get("service_tier") or "auto",
        "text": data.get("text"),
        "truncation": data.get("truncation", "disabled"),
        "user": data.get("user"),
    }
    return ResponsesRequest(
        model=model,
        instructions=instructions,
        inputs=tuple(inputs),
        request_id=request_id,
        store=store,
        background=background,
        stream=stream,
        previous_response_id=previous,
        max_output_tokens=max_output_tokens,
        logprobs=logprobs,
        sampling=sampling,
        echo=echo,
    )


def _before_validators(data: Mapping[str, Any]) -> None:
    """``ResponsesRequest``'s "before" validators that the simulator models, in the order pydantic runs them."""
    tools = data.get("tools")
    choice = data.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not (isinstance(tools, list) and tools):
        if choice == "required":
            raise vllm_error("Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
        if named:
            raise vllm_error("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
    if data.get("prompt") is not None:
        raise vllm_error("prompt template is not supported", param="prompt")
    if data.get("background") and not data.get("store", True):
        raise vllm_error("background can only be used when `store` is true", param="background")
    check_cache_salt(data)


def _input(data: Mapping[str, Any], fields: Fields) -> list[str] | None:
    """The input's message texts: a string is one message; a list holds items, each a message (its content a string
    or parts with ``text``) or another item (a tool call's ``arguments``, a tool's ``output``). pydantic's errors else
    (for a malformed item the simulator's own second line: vLLM lists every branch of its item union)."""
    if "input" not in data:
        fields.errors.append(FieldError("missing", "body.input", "Field required", data))
        return None
    value = data["input"]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        fields.errors.append(FieldError("string_type", "body.input", "Input should be a valid string", value))
        fields.errors.append(FieldError("list_type", "body.input", "Input should be a valid list", value))
        return None
    texts: list[str] = []
    for index, item in enumerate(value):
        text = _item_text(item)
        if text is None:
            fields.errors.append(FieldError("string_type", "body.input", "Input should be a valid string", value))
            fields.errors.append(FieldError("missing", f"body.input.{index}.content", "Field required", item))
            return None
        texts.append(text)
    return texts


def _item_text(item: object) -> str | None:
    """One input item's text, or None when it is no item the simulator reads."""
    if not isinstance(item, dict):
        return None
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        if len(parts) != len(content):
            return None
        return "".join(text for text in parts if isinstance(text, str))
    for key in ("output", "arguments"):  # function_call_output, function_call
        if isinstance(item.get(key), str):
            return str(item[key])
    if item.get("type") == "reasoning":
        return ""
    return None


@dataclass
class _Stored:
    """A kept response: its body as ``GET`` answers it, the conversation it answered, and its sequence."""

    body: dict[str, Any]
    conversation: list[str]  # the instructions' and input's texts (what a next turn repeats before its output)
    sequence: Sequence
    final: Callable[[], dict[str, Any]] | None = None  # background: builds its body once the sequence has ended

    def refresh(self) -> None:
        """A background response whose sequence ended (and was not cancelled) is its final body from now on."""
        if self.final is not None and self.sequence.finished:
            self.body, self.final = self.final(), None

    def history(self) -> list[str]:
        """What a response continuing this one puts before its input: this one's conversation and output."""
        return [*self.conversation, detokenize(self.sequence.token_ids)]


class Responses:
    """One engine's Responses API, with vLLM's in-memory store when ``store`` (``VLLM_ENABLE_RESPONSES_API_STORE``)."""

    def __init__(self, generation: Generation, answer: Answer, new_id: Callable[[], str], *, store: bool = False) -> None:
        self._generation = generation
        self._answer = answer
        self._new_id = new_id
        self._store: dict[str, _Stored] | None = {} if store else None

    async def create(self, headers: Mapping[str, str], body: bytes) -> SimResponse:
        """``POST /v1/responses``: the response whole, queued (``background``) or streamed."""
        request = parse(headers.get("content-type"), body)
        check_model_name(request.model, self._answer.model)
        if request.store and request.background and self._store is None:
            raise ApiError(400, STORE_OFF_MESSAGE, param="background", kind="invalid_request_error")
        generation = self._generation
        generation.admit()
        keep = request.store and self._store is not None
        history = [] if request.previous_response_id is None else self._find(request.previous_response_id).history()
        completion = request.completion(history)
        max_tokens = generation.render(completion)
        limit = generation.engine.params.max_model_len
        if completion.prompt_tokens >= limit:  # _validate_generator_input: no room for one output token
            raise ApiError(
                400,
                f"The engine prompt length {completion.prompt_tokens} exceeds the max_model_len {limit}. Please reduce prompt.",
                param="input",
                kind="invalid_request_error",
            )
        response_id = request.request_id or f"resp_{self._new_id()}"
        (sequence,) = generation.submit(completion, max_tokens, f"{response_id}_0")
        shaper = _Shaper(self._answer, request, response_id, max_tokens, f"msg_{self._new_id()}")
        conversation = [*([request.instructions] if request.instructions is not None else []), *history, *request.inputs]

        def keep_final(final: dict[str, Any]) -> None:
            store = self._store
            if keep and store is not None and not (response_id in store and store[response_id].body["status"] == "cancelled"):
                store[response_id] = _Stored(final, conversation, sequence)

        if request.background and self._store is not None:  # the engine runs it on its own, its reader or none
            queued = shaper.response("queued")
            self._store[response_id] = _Stored(queued, conversation, sequence, final=lambda: shaper.final(sequence))
            if not request.stream:
                return SimResponse.json(200, queued)
            return SimResponse.sse(ResponseStream(generation, sequence, shaper, keep_final, detached=True))
        if request.stream:
            return SimResponse.sse(ResponseStream(generation, sequence, shaper, keep_final))
        await generation.finish([sequence])
        final = shaper.final(sequence)
        keep_final(final)
        return SimResponse.json(200, final)

    def retrieve(self, response_id: str) -> SimResponse:
        """``GET /v1/responses/{id}``: a kept response as it stands (404 unless kept)."""
        return SimResponse.json(200, self._find(response_id).body)

    def cancel(self, response_id: str) -> SimResponse:
        """``POST /v1/responses/{id}/cancel``: a queued background response is aborted and reads "cancelled"."""
        stored = self._find(response_id)
        if stored.body["status"] not in ("queued", "in_progress"):
            raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id", kind="invalid_request_error")
        stored.final = None
        stored.body = {**stored.body, "status": "cancelled"}
        self._generation.engine.abort(stored.sequence)
        return SimResponse.json(200, stored.body)

    def _find(self, response_id: str) -> _Stored:
        stored = None if self._store is None else self._store.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", kind="invalid_request_error")
        stored.refresh()
        return stored


class _Shaper:
    """One response's bodies and items, as vLLM's ``ResponsesResponse.from_request`` fills them from the request."""

    def __init__(self, answer: Answer, request: ResponsesRequest, response_id: str, max_tokens: int, item_id: str) -> None:
        self.answer = answer
        self.request = request
        self.response_id = response_id
        self.max_tokens = max_tokens
        self.item_id = item_id
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request, sampling, echo = self.request, self.request.sampling, self.request.echo
        body: dict[str, Any] = {
            "id": self.response_id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "metadata": echo["metadata"],
            "model": self.answer.model,
            "object": "response",
            "output": output or [],
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "temperature": sampling["temperature"],
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_p": sampling["top_p"],
            "background": request.background,
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": echo["max_tool_calls"],
            "previous_response_id": request.previous_response_id,
            "prompt": None,
            "reasoning": echo["reasoning"],
            "service_tier": echo["service_tier"],
            "status": status,
            "text": echo["text"],
            "top_logprobs": request.logprobs,
            "truncation": echo["truncation"],
            "usage": usage,
            "user": echo["user"],
        }
        if metrics is not None:  # vLLM leaves the field out when it is null
            body["metrics"] = metrics
        body.update(
            presence_penalty=sampling["presence_penalty"],
            frequency_penalty=sampling["frequency_penalty"],
            kv_transfer_params=None,
            ec_transfer_params=None,
            input_messages=None,
            output_messages=None,
        )
        return body

    def final(self, sequence: Sequence) -> dict[str, Any]:
        """The response once its sequence ended: status, its one message, usage, and metrics when the server gives them."""
        status = "incomplete" if sequence.finish_reason == "length" else "completed"
        metrics = whole_timing(sequence) if self.answer.per_request_metrics else None
        return self.response(status, [self.message(sequence.token_ids)], self.usage(sequence), metrics)

    def message(self, token_ids: list[int], status: str = "completed") -> dict[str, Any]:
        """The output's message item (no content part when there is no text, as vLLM's)."""
        text = detokenize(token_ids)
        content = [self.part(text, token_ids)] if text else []
        return {"id": self.item_id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": None}

    def part(self, text: str, token_ids: list[int] | None) -> dict[str, Any]:
        """An ``output_text`` part: its logprobs when asked for (None: a part just opened, whose logprobs are [])."""
        top = self.request.logprobs
        logprobs: list[dict[str, Any]] | None = [] if token_ids is None else None
        if top is not None and token_ids is not None:
            logprobs = responses_logprobs(token_ids, 0, top)
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def usage(self, sequence: Sequence) -> dict[str, Any]:
        prompt, output = sequence.prompt_tokens, len(sequence.token_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": sequence.cached_tokens,
                "cache_write_tokens": cache_written(sequence, self.answer.cache_block),
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": output,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": prompt + output,
        }


class ResponseStream(SequenceStream):
    """vLLM's event stream of one response (the module's docstring lists it); ``keep`` gets the final response."""

    def __init__(
        self, generation: Generation, sequence: Sequence, shaper: _Shaper, keep: Callable[[dict[str, Any]], None], *, detached: bool = False
    ) -> None:
        self._shaper = shaper
        self._keep = keep
        self._number = 0
        start = shaper.response("in_progress")
        opening = self._event("response.created", {"response": start}) + self._event("response.in_progress", {"response": start})
        super().__init__(generation.engine, sequence, opening, detached=detached)

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        fields["sequence_number"] = self._number
        fields["type"] = kind
        self._number += 1
        return sse(kind, json.dumps(fields, separators=_COMPACT).encode())

    def tokens(self, token_ids: list[int], position: int) -> bytes:
        shaper, item = self._shaper, self._shaper.item_id
        out = b""
        if not position:
            out += self._event("response.output_item.added", {"item": shaper.message([], "in_progress"), "output_index": 0})
            out += self._event(
                "response.content_part.added", {"content_index": 0, "item_id": item, "output_index": 0, "part": shaper.part("", None)}
            )
        top = shaper.request.logprobs
        logprobs = [] if top is None else responses_logprobs(token_ids, position, top, stream=True)
        delta = {"content_index": 0, "delta": detokenize(token_ids), "item_id": item, "logprobs": logprobs, "output_index": 0}
        return out + self._event("response.output_text.delta", delta)

    def closing(self) -> bytes:
        shaper, sequence = self._shaper, self.sequence
        final = shaper.final(sequence)
        (message,) = final["output"]
        part = message["content"][0] if message["content"] else shaper.part("", [])
        item = {"content_index": 0, "item_id": shaper.item_id}
        out = self._event("response.output_text.done", {**item, "logprobs": [], "output_index": 0, "text": part["text"]})
        out += self._event("response.content_part.done", {**item, "output_index": 0, "part": part})
        out += self._event("response.output_item.done", {"item": message, "output_index": 0})
        out += self._event("response.completed", {"response": final})
        self._keep(final)
        return out

