"""Size estimate and caps: the first, cheapest line of defence for the tail.

The estimate decides both the input cap and the class, so it must not be
fooled by a script or a field: it is an upper bound of the simulator's
tokenizer rule (``bench/sim/tokens.py``) for any Unicode text, checked by a
property test (tests/test_estimate.py). The rule, with the defaults:

- a CJK character (the ranges below) is ``1 / cjk_chars_per_token`` token;
- all other text is one token per ``chars_per_token`` UTF-8 *bytes*: for
  ASCII that is the familiar 4 characters a token, while 2-, 3- and 4-byte
  characters (Cyrillic, Thai, emoji) cost 2, 3 and 4 times as much, since a
  byte-level tokenizer may spend a token per few bytes of them;
- every text rounds up on its own; a chat adds ``per_message_tokens`` per
  message and once more for the assistant's reply that the template opens;
- every field vLLM renders into the prompt counts: message content (text
  parts of a list too), a non-standard role, every other message field
  (``name``, ``tool_calls``, ``tool_call_id``, ...) and the prompt-shaping
  parameters in _PROMPT_PARAMS (``tools``, schemas, ...), structured ones by
  their JSON text.

The backend's tokenizer is the truth, and vLLM still refuses what does not
fit; the estimate only has to be cheap (an ASCII fast path) and never low.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from .config_types import EstimateConfig, LimitsConfig
from .errors import InvalidRequest, MaxTokensTooLarge, PromptTooLong
from .request import RouterRequest

_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0002fa1f]"
)

# Parameters vLLM turns into prompt tokens (tools and documents are rendered
# by the chat template, a template is text itself) or that cost like them
# (a structured-output schema is compiled per request). Counted by JSON text.
_PROMPT_PARAMS = frozenset({
    "tools", "functions", "tool_choice", "function_call", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "documents", "chat_template", "chat_template_kwargs", "suffix",
})

# What a chat template's ``tojson`` prints (transformers' filter keeps
# non-ASCII as is); one encoder, built once, saves ~1.5 µs a call.
_TO_JSON = json.JSONEncoder(ensure_ascii=False).encode

# Roles whose names the per-message overhead already covers; any other role
# string is counted as text (a template prints it).
_PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})


def estimate_text_tokens(text: str, estimate: EstimateConfig) -> int:
    """Estimated tokens of one text: CJK characters by count, the rest by UTF-8 bytes."""
    if text.isascii():
        return math.ceil(len(text) / estimate.chars_per_token)
    rest = _CJK.sub("", text)
    cjk = len(text) - len(rest)
    other_bytes = len(rest.encode("utf-8", "surrogatepass"))
    return math.ceil(cjk / estimate.cjk_chars_per_token + other_bytes / estimate.chars_per_token)


def estimate_prompt_tokens(request: RouterRequest, estimate: EstimateConfig) -> int:
    """Estimated prompt tokens of a request: chat template overhead, tools and
    schemas included (see the module docstring for the rule)."""
    if request.kind == "chat":
        messages = request.messages or ()
        tokens = estimate.per_message_tokens * (len(messages) + 1)
        for message in messages:
            tokens += _message_tokens(message, estimate)
    else:
        tokens = sum(estimate_text_tokens(text, estimate) for text in request.texts()) + request.prompt_token_ids()
    for key, value in request.params.items():
        if key in _PROMPT_PARAMS and value is not None:
            tokens += _value_tokens(value, estimate)
    return max(1, tokens)


def _message_tokens(message: Mapping[str, object], estimate: EstimateConfig) -> int:
    """One message's own tokens (the per-message overhead is added by the caller)."""
    tokens = 0
    for key, value in message.items():
        if key == "content":
            if isinstance(value, str):
                tokens += estimate_text_tokens(value, estimate)
            elif isinstance(value, list):
                # Text parts only: an image or audio part's tokens depend on the
                # model's processor, which the router cannot know.
                for part in value:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if isinstance(text, str):
                        tokens += estimate_text_tokens(text, estimate)
        elif key == "role":
            if value not in _PLAIN_ROLES:
                tokens += _value_tokens(value, estimate)
        elif value is not None:
            tokens += _value_tokens(value, estimate)
    return tokens


def _value_tokens(value: object, estimate: EstimateConfig) -> int:
    """A string as text; anything else as the JSON text a template's ``tojson`` prints."""
    if isinstance(value, str):
        return estimate_text_tokens(value, estimate)
    if isinstance(value, (int, float)):  # a number's JSON text is as long as its str() (a bool's too): no encoder call
        return math.ceil(len(str(value)) / estimate.chars_per_token)
    return estimate_text_tokens(_TO_JSON(value), estimate)


def check_prompt(prompt_tokens: int, limits: LimitsConfig) -> None:
    """Raise PromptTooLong when the estimate is over the input cap."""
    if prompt_tokens > limits.input_cap_tokens:
        raise PromptTooLong(
            f"the prompt (messages, tools and schemas counted) is about {prompt_tokens} tokens, over this "
            f"service's input cap of {limits.input_cap_tokens} tokens; shorten it or split the document",
            param="messages",
        )


def effective_max_tokens(requested: int | None, limits: LimitsConfig) -> tuple[int, bool]:
    """The max_tokens to send and whether it was clamped.

    Absent -> the default; over the cap -> the cap (``clamp``) or
    MaxTokensTooLarge (``reject``).
    """
    if requested is None:
        return limits.default_max_tokens, False
    if requested <= limits.output_cap_tokens:
        return requested, False
    if limits.over_cap == "reject":
        raise MaxTokensTooLarge(
            f"max_tokens {requested} is over this service's output cap of {limits.output_cap_tokens}",
            param="max_tokens",
        )
    return limits.output_cap_tokens, True


def check_sequences(sequences: int, limits: LimitsConfig) -> int:
    """``sequences`` (a request's ``n``), or InvalidRequest when it is over ``limits.max_n``."""
    if sequences > limits.max_n:
        raise InvalidRequest(
            f"n = {sequences} is over this service's limit of {limits.max_n} choices a request (limits.max_n); "
            "each choice runs as a sequence of its own: ask for fewer, or send several requests",
            param="n",
        )
    return sequences


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, pool: str) -> None:
    """Raise PromptTooLong when prompt + max_tokens cannot fit the pool's model."""
    if prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLong(
            f"the prompt (about {prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"{max_model_len}-token context of the models in pool {pool!r}; lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
