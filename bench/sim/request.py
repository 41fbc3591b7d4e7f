"""A completion request checked as vLLM 0.32's OpenAI server checks it: in its order, in its words.

vLLM refuses a bad request at one of several stages, and which answer a
client gets depends on the first stage that fails (checked against a
running vLLM 0.32, docs/simulator.md):

1. the media type (``validate_json_request``) and the body's JSON;
2. the request model's "before" validators, last defined first
   (``validate_prompt_and_prompt_embeds``, ``validate_stream_options``,
   ``check_logprobs``, ``check_cache_salt_support`` in
   vllm/entrypoints/openai/{completion,chat_completion}/protocol.py): they
   raise ``VLLMValidationError``, a "BadRequestError" naming its parameter;
3. pydantic's field types, all at once ("N validation errors", "Bad
   Request"); ``parse`` covers these three;
4. the model name (404), then the engine's admission queue (503) -- both
   in ``SimApp``;
5. the renderer (``render``): ``max_tokens`` over ``max_model_len``, the
   prompt's characters and tokens over the context;
6. ``get_max_tokens``, which cuts ``max_tokens`` to what the context leaves
   (a prompt plus ``max_tokens`` over the context is served, and ends
   "length" at the context), then ``SamplingParams``' ranges, in its order
   (``sample``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .api_errors import ApiError, FieldError, bare_validation_error, validation_error, vllm_error
from .tokens import ASSISTANT_PRIMING_TOKENS, PER_MESSAGE_TOKENS, VOCABULARY_SIZE, chat_prompt_key, count_chat_tokens, count_text_tokens

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens' default (null too: normalize_null_max_tokens)
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs' default
MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES' default
CHARS_PER_TOKEN = 4  # the simulator's tokenizer's longest token, in characters (vLLM's max_chars_per_token)
_GREEDY_EPS = 1e-5  # SamplingParams' _SAMPLING_EPS: below it, temperature means greedy
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # pydantic's lax booleans
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True)
class CompletionRequest:
    """What the engine and the answer need from a request that passed stages 1-3."""

    chat: bool
    model: str | None
    prompt_tokens: int
    prompt_key: str  # the text as the prefix cache keys it (a chat's contents joined by NUL)
    prompt_chars: int | None  # characters vLLM's text-length check counts; None: token ids
    encoding_error: str | None  # the codec's complaint about text UTF-8 cannot encode (the renderer's 400), else None
    exact: bool  # token ids: the count is exact, not "at least"
    empty_conversation: bool  # a chat with no messages: refused by the renderer, after the model check
    max_tokens: int | None  # as requested (completions: 16 when absent or null; None: fill the context)
    max_tokens_param: str  # the field that set it: "max_tokens" or "max_completion_tokens"
    n: int
    stream: bool
    include_usage: bool
    seed: int | None
    min_tokens: int
    ignore_eos: bool
    priority: int
    cache_salt: str | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None  # sample logprobs to return (chat: top_logprobs when logprobs is true)


class Fields:
    """pydantic's lax field validation of a JSON object: values coerced as it does, errors collected in field order."""

    def __init__(self, data: Mapping[str, Any], prefix: str = "body") -> None:
        self.data = data
        self.prefix = prefix
        self.errors: list[FieldError] = []

    def _fail(self, name: str, kind: str, msg: str, value: object, ctx: dict[str, object] | None = None) -> None:
        self.errors.append(FieldError(kind, f"{self.prefix}.{name}", msg, value, ctx))

    def integer(self, name: str, default: int | None, *, nullable: bool = True, bounded: bool = False) -> int | None:
        """An int field: ``default`` when absent, None when null (an error when it may not be), else pydantic's lax int."""
        if name not in self.data:
            return default
        value = self.data[name]
        if value is None:
            if not nullable:
                self._fail(name, "int_type", "Input should be a valid integer", value)
                return default
            return None
        number: int | None = None
        if isinstance(value, (bool, int)):
            number = int(value)
        elif isinstance(value, float):
            if value.is_integer():
                number = int(value)
            else:
                self._fail(name, "int_from_float", "Input should be a valid integer, got a number with a fractional part", value)
        elif isinstance(value, str):
            text = value.strip()
            digits = text[1:] if text[:1] in ("+", "-") else text
            if digits.isascii() and digits.isdigit():
                number = int(text)
            else:
                self._fail(name, "int_parsing", "Input should be a valid integer, unable to parse string as an integer", value)
        else:
            self._fail(name, "int_type", "Input should be a valid integer", value)
        if number is None:
            return default
        if bounded and number > INT64_MAX:
            self._fail(name, "less_than_equal", f"Input should be less than or equal to {INT64_MAX}", value, {"le": INT64_MAX})
            return default
        if bounded and number < INT64_MIN:
            self._fail(name, "greater_than_equal", f"Input should be greater than or equal to {INT64_MIN}", value, {"ge": INT64_MIN})
            return default
        return number

    def number(self, name: str) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, (bool, int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                self._fail(name, "float_parsing", "Input should be a valid number, unable to parse string as a number", value)
                return None
        self._fail(name, "float_type", "Input should be a valid number", value)
        return None

    def boolean(self, name: str, *, nullable: bool = True) -> bool:
        if name not in self.data:
            return False
        value = self.data[name]
        if value is None:
            if not nullable:
                self._fail(name, "bool_type", "Input should be a valid boolean", value)
            return False
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, (int, float, str)):
            self._fail(name, "bool_parsing", "Input should be a valid boolean, unable to interpret input", value)
        else:
            self._fail(name, "bool_type", "Input should be a valid boolean", value)
        return False

    def text(self, name: str) -> str | None:
        value = self.data.get(name)
        if value is None or isinstance(value, str):
            return value
        self._fail(name, "string_type", "Input should be a valid string", value)
        return None

    def nested(self, name: str) -> Fields | None:
        """A nested object (``stream_options``): its own fields, errors reported under its name."""
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            self._fail(name, "model_attributes_type", "Input should be a valid dictionary or object to extract fields from", value)
            return None
        nested = Fields(value, f"{self.prefix}.{name}")
        nested.errors = self.errors
        return nested


def parse(chat: bool, content_type: str | None, body: bytes) -> CompletionRequest:
    """Stages 1-3: media type, JSON, the request model's validators and field types. Raises ApiError."""
    require_json_media(content_type)
    data = load_json_object(body)
    _before_validators(chat, data)
    fields = Fields(data)
    model = fields.text("model")
    if chat:
        request = _chat_fields(fields, data, model)
    else:
        request = _completion_fields(fields, data, model)
    if fields.errors:
        raise validation_error(fields.errors)
    assert request is not None
    return request


def require_json_media(content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: a JSON route takes ``application/json`` (any parameters) and nothing else."""
    if (content_type or "").lower().split(";", 1)[0].strip() != "application/json":
        raise bare_validation_error("Unsupported Media Type: Only 'application/json' is allowed")


def load_json_object(body: bytes) -> dict[str, Any]:
    """The body as FastAPI reads it for a pydantic model: JSON, and an object."""
    if not body:
        raise validation_error([FieldError("missing", "body", "Field required", None)])
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        raise validation_error([FieldError("json_invalid", f"body.{error.pos}", "JSON decode error", {}, {"error": error.msg})]) from None
    except UnicodeDecodeError as error:
        raise validation_error([FieldError("json_invalid", f"body.{error.start}", "JSON decode error", {}, {"error": error.reason})]) from None
    if not isinstance(data, dict):
        raise validation_error([FieldError("model_attributes_type", "body", "Input should be a valid dictionary or object to extract fields from", data)])
    return data


def _before_validators(chat: bool, data: Mapping[str, Any]) -> None:
    """The request model's "before" validators that the simulator models, last defined first, as pydantic runs them."""
    if not chat:
        prompt = data.get("prompt")
        if prompt is None or prompt == "":
            raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if chat:
        _check_chat_logprobs(data)
    if data.get("stream_options") and not data.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", param="stream_options")
    if not chat:
        logprobs = data.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, (int, float)):
            raise vllm_error("`logprobs` must be an integer.", param="logprobs", value=logprobs)
        if logprobs is not None and logprobs < 0 and logprobs != -1:
            raise vllm_error("`logprobs` must be a positive value or -1.", param="logprobs", value=logprobs)
    check_cache_salt(data)


def check_cache_salt(data: Mapping[str, Any]) -> None:
    """The request models' ``check_cache_salt_support``: a non-empty string of at most 128 characters, none of ``@/\\``, NUL."""
    salt = data.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise vllm_error("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        if len(salt) > 128 or any(char in "@/\\\x00" for char in salt):
            raise vllm_error(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
                param="cache_salt",
            )


def _check_chat_logprobs(data: Mapping[str, Any]) -> None:
    top = data.get("top_logprobs")
    if top is not None and not isinstance(top, (int, float)):
        raise vllm_error("`top_logprobs` must be an integer.", param="top_logprobs", value=top)
    if top is not None:
        if top < 0 and top != -1:
            raise vllm_error("`top_logprobs` must be a positive value or -1.", param="top_logprobs", value=top)
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")


def _completion_fields(fields: Fields, data: Mapping[str, Any], model: str | None) -> CompletionRequest | None:
    prompt = data.get("prompt")
    shape = _prompt_shape(prompt, fields)
    fields.boolean("echo")
    frequency = fields.number("frequency_penalty")
    logprobs = fields.integer("logprobs", None)
    max_tokens = fields.integer("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens is None:  # null reads as the default (normalize_null_max_tokens)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    n = fields.integer("n", 1, nullable=False)
    sampling = _sampling(fields)
    priority = fields.integer("priority", 0, nullable=False, bounded=True)
    salt = fields.text("cache_salt")
    if shape is None or fields.errors:
        return None
    tokens, key, chars, encoding_error, exact = shape
    return CompletionRequest(
        chat=False,
        model=model,
        prompt_tokens=tokens,
        prompt_key=key,
        prompt_chars=chars,
        encoding_error=encoding_error,
        exact=exact,
        empty_conversation=False,
        max_tokens=max_tokens,
        max_tokens_param="max_tokens",
        n=1 if n is None else n,
        priority=priority or 0,
        cache_salt=salt,
        frequency_penalty=_or(frequency, 0.0),
        **sampling,
        logprobs=logprobs,
    )


def _chat_fields(fields: Fields, data: Mapping[str, Any], model: str | None) -> CompletionRequest | None:
    if "messages" not in data:
        fields.errors.append(FieldError("missing", "body.messages", "Field required", data))
        contents: list[str] | None = None
    else:
        contents = message_contents(data["messages"])
    frequency = fields.number("frequency_penalty")
    logprobs = fields.boolean("logprobs")
    top_logprobs = fields.integer("top_logprobs", 0)
    max_tokens = fields.integer("max_tokens", None)
    max_completion = fields.integer("max_completion_tokens", None)
    n = fields.integer("n", 1)
    sampling = _sampling(fields)
    fields.boolean("echo", nullable=False)
    priority = fields.integer("priority", 0, nullable=False, bounded=True)
    salt = fields.text("cache_salt")
    if contents is None or fields.errors:
        return None
    return CompletionRequest(
        **chat_prompt(contents),
        model=model,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        max_tokens_param="max_completion_tokens" if max_completion is not None else "max_tokens",
        n=1 if n is None else n,  # null reads as 1 in a chat request
        priority=priority or 0,
        cache_salt=salt,
        frequency_penalty=_or(frequency, 0.0),
        **sampling,
        logprobs=(top_logprobs or 0) if logprobs else None,
    )


def chat_prompt(contents: list[str]) -> dict[str, Any]:
    """The prompt fields of a ``CompletionRequest`` for a chat of these message texts (``chat`` included).

    Text UTF-8 cannot encode is refused by the renderer, after the model and
    queue checks: it is kept as its encoding error, with nothing to count.
    """
    encoding_error = unencodable(contents)
    if encoding_error is not None:
        contents = ["?"]
    chars = sum(len(text) for text in contents) + CHARS_PER_TOKEN * (PER_MESSAGE_TOKENS * len(contents) + ASSISTANT_PRIMING_TOKENS)
    return {
        "chat": True,
        "prompt_tokens": count_chat_tokens(contents) if contents else 0,
        "prompt_key": chat_prompt_key(contents),
        "prompt_chars": chars,
        "encoding_error": encoding_error,
        "exact": False,
        "empty_conversation": not contents,
    }


def _sampling(fields: Fields) -> dict[str, Any]:
    """The fields both APIs share, from ``presence_penalty`` to ``min_tokens``, checked in vLLM's order (its
    errors come in the order of the model's fields): the request's values, defaults for nulls."""
    presence = fields.number("presence_penalty")
    seed = fields.integer("seed", None, bounded=True)
    stream = fields.boolean("stream")
    options = fields.nested("stream_options")
    include_usage = options.boolean("include_usage") if options is not None else False
    if options is not None:
        options.boolean("continuous_usage_stats")
    temperature = fields.number("temperature")
    top_p = fields.number("top_p")
    top_k = fields.integer("top_k", None)
    min_p = fields.number("min_p")
    repetition = fields.number("repetition_penalty")
    ignore_eos = fields.boolean("ignore_eos", nullable=False)
    min_tokens = fields.integer("min_tokens", 0, nullable=False)
    return {
        "stream": stream,
        "include_usage": include_usage,
        "seed": seed,
        "min_tokens": min_tokens or 0,
        "ignore_eos": ignore_eos,
        "temperature": _or(temperature, 1.0),
        "top_p": _or(top_p, 1.0),
        "top_k": top_k or 0,
        "min_p": _or(min_p, 0.0),
        "presence_penalty": _or(presence, 0.0),
        "repetition_penalty": _or(repetition, 1.0),
    }


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


PromptShape = tuple[int, str, int | None, str | None, bool]  # tokens, key, characters, encoding error, exact


def _prompt_shape(prompt: object, fields: Fields) -> PromptShape | None:
    """A completion's prompt: one text, or one list of token ids (vLLM's union's other branches are batches)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        error = unencodable([prompt])
        if error is not None:
            return 1, "", len(prompt), error, False
        return max(1, count_text_tokens(prompt)), prompt, len(prompt), None, False
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), ",".join(map(str, prompt)), None, None, True
    if not isinstance(prompt, list):  # pydantic's errors for each branch of the union it tried
        for kind, msg in (("list_type", "list"), ("list_type", "list"), ("string_type", "string"), ("list_type", "list")):
            fields.errors.append(FieldError(kind, "body.prompt", f"Input should be a valid {msg}", prompt))
        return None
    # A batch of prompts (vLLM answers each as its own choices): not simulated.
    raise ApiError(400, "the simulator serves one prompt per request: a string, a one-element list, or a list of token ids", param="prompt")


def message_contents(messages: object) -> list[str]:
    """A chat's message texts (the simulator's own checks of their shape; vLLM's union of message types reports more)."""
    if not isinstance(messages, list):
        raise validation_error([FieldError("list_type", "body.messages", "Input should be a valid list", messages)])
    contents: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a string role", param="messages")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{index}].content parts must be text parts", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{index}].content must be a string or a list of parts", param="messages")
        contents.append(content)
    return contents


def check_model(request: CompletionRequest, served: str) -> None:
    """vLLM's ``_check_model``: an unknown name is a 404 naming the served ones (no name, or "", is the served model)."""
    check_model_name(request.model, served)


def check_model_name(model: str | None, served: str) -> None:
    """``check_model`` of a bare name (the routes whose requests are not completions)."""
    if model and model != served:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", param="model")


def render(request: CompletionRequest, max_model_len: int, max_chars_per_token: int = CHARS_PER_TOKEN) -> int:
    """Stage 5, the renderer's checks, then ``get_max_tokens``: the ``max_tokens`` the engine runs. Raises ApiError.

    ``max_tokens`` (or ``max_completion_tokens``) over ``max_model_len`` is
    refused (``TokenizeParams``); a text over ``max_model_len`` x the
    tokenizer's longest token (``max_chars_per_token``) is refused before it is tokenized
    (``input_text``); a prompt over ``max_model_len`` tokens is refused
    (``input_tokens``: text is tokenized only one token past the bound, so
    its count reads "at least"). Then ``max_tokens`` is cut to what the
    context leaves: a prompt plus ``max_tokens`` over the context is served
    and ends "length" at the context.
    """
    limit = max_model_len
    requested = request.max_tokens
    if requested and requested > limit:
        param = request.max_tokens_param
        raise vllm_error(
            f"{param}={requested} cannot be greater than max_model_len={limit}. Please request fewer output tokens.",
            param=param,
            value=requested,
        )
    if request.empty_conversation:
        raise ApiError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
    check_input_length(
        request.prompt_chars, request.prompt_tokens, limit, max_chars_per_token, exact=request.exact, encoding_error=request.encoding_error
    )
    room = limit - request.prompt_tokens
    return room if requested is None else min(room, requested)


def check_input_length(
    chars: int | None, tokens: int, limit: int, max_chars_per_token: int, *, exact: bool, encoding_error: str | None = None
) -> None:
    """The renderer's length checks of a prompt of ``chars`` characters (None: token ids) and ``tokens`` tokens.

    A text over ``limit`` x ``max_chars_per_token`` characters is refused
    before it is tokenized (``input_text``); text UTF-8 cannot encode
    (``encoding_error``) is refused as it is encoded; a prompt over ``limit``
    tokens is refused (``input_tokens``: text is tokenized only one token past
    the bound, so unless the count is ``exact`` it reads "at least").
    """
    bound = limit * max_chars_per_token
    if chars is not None and chars > bound:
        raise vllm_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains "
            f"{chars} characters (more than {bound} characters, which is the upper bound for "
            f"{limit} input tokens). Please reduce the length of the input prompt.",
            param="input_text",
            value=chars,
        )
    if encoding_error is not None:
        raise ApiError(400, encoding_error)
    if tokens > limit:
        counted = tokens if exact else limit + 1
        qualifier = "at least " if counted == limit + 1 else ""
        raise vllm_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains {qualifier}{counted} "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
            value=counted,
        )


def unencodable(texts: list[Any]) -> str | None:
    """The codec's message for text UTF-8 cannot encode (a lone UTF-16 surrogate such as "\\ud866"), else None.

    JSON allows such escapes and Python decodes them; vLLM's renderer fails
    to encode the text for the tokenizer and its error handler turns that
    ``UnicodeEncodeError`` (a ``ValueError``) into a 400 ``BadRequestError``
    carrying the codec's message. A tokenizer that panics instead, closing
    the connection without an answer, is the ``tokenizer_panic`` fault mode.
    """
    for text in texts:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                return str(error)
    return None


def require_encodable(texts: list[Any]) -> None:
    """Raise the renderer's 400 (``unencodable``) for text UTF-8 cannot encode."""
    error = unencodable(texts)
    if error is not None:
        raise ApiError(400, error)


def sample(request: CompletionRequest, max_tokens: int) -> None:
    """Stage 6: ``SamplingParams``' checks in its order and words, then the logprobs cap. Raises ApiError.

    Only temperature, top_p, max_tokens and logprobs name their parameter;
    the others answer ``param: null``, as vLLM does.
    """
    n = request.n
    if n < 1:
        raise vllm_error(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise vllm_error(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.")
    for name, value in (("presence_penalty", request.presence_penalty), ("frequency_penalty", request.frequency_penalty)):
        if not -2.0 <= value <= 2.0:
            raise vllm_error(f"{name} must be in [-2, 2], got {value}.")
    repetition = request.repetition_penalty
    if not math.isfinite(repetition):
        raise vllm_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise vllm_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = request.temperature
    if not math.isfinite(temperature):
        raise vllm_error(f"temperature must be a finite number, got {temperature}.", param="temperature", value=temperature)
    if temperature < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {temperature}.", param="temperature", value=temperature)
    if temperature > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {temperature}.", param="temperature", value=temperature)
    if not 0.0 < request.top_p <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {request.top_p}.", param="top_p", value=request.top_p)
    if request.top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {request.top_k}.")
    if not 0.0 <= request.min_p <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {request.min_p}.")
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens", value=max_tokens)
    if request.min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {request.min_tokens}.")
    if request.min_tokens > max_tokens:
        raise vllm_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {request.min_tokens}.")
    if temperature < _GREEDY_EPS and n > 1:
        raise vllm_error(f"n must be 1 when using greedy sampling, got {n}.")
    if request.logprobs:
        wanted = VOCABULARY_SIZE if request.logprobs == -1 else request.logprobs
        if wanted > MAX_LOGPROBS:
            raise vllm_error(
                f"Requested sample logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                param="logprobs",
                value=wanted,
            )
