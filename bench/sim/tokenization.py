"""``POST /tokenize`` and ``POST /detokenize``, as vLLM 0.32 serves them (outside ``/v1``: no API key asked).

``/tokenize`` takes a text (``prompt``, a string: vLLM's
``TokenizeCompletionRequest``) or a chat (``messages``, with
``add_generation_prompt``, true by default: ``TokenizeChatRequest``; a body
with both is read as the chat) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; it never refuses a text for its length.
``/detokenize`` takes ``tokens`` (integers from 0 to 2^63 - 1) and answers
``{"prompt": text}``; an id of no token decodes to nothing, as vLLM's does.

The ids are the simulator's own (``tokens.prompt_token_ids``: a 4-character
chunk of text per token), so ``/detokenize`` gives an ASCII text back from its
``/tokenize`` ids, and an answer's output token ids back as its words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .api_errors import FieldError, validation_error
from .request import INT64_MAX, Fields, check_model_name, load_json_object, message_contents, require_encodable, require_json_media
from .tokens import ASSISTANT_PRIMING_TOKENS, chat_prompt_key, count_chat_tokens, count_text_tokens, prompt_token_ids, token_text


def tokenize(headers: Mapping[str, str], body: bytes, *, model: str, max_model_len: int) -> dict[str, Any]:
    """``/tokenize``'s answer. Raises ApiError: the media type, the JSON, pydantic's errors, the model (404), text UTF-8
    cannot encode (400)."""
    require_json_media(headers.get("content-type"))
    data = load_json_object(body)
    fields = Fields(data)
    fields.text("model")
    strs = fields.boolean("return_token_strs")
    if "messages" in data:
        generation_prompt = fields.boolean("add_generation_prompt") if "add_generation_prompt" in data else True
        if fields.errors:
            raise validation_error(fields.errors)
        contents = message_contents(data["messages"])
        check_model_name(data.get("model"), model)
        require_encodable(contents)
        count = count_chat_tokens(contents) - (0 if generation_prompt else ASSISTANT_PRIMING_TOKENS)
        key = chat_prompt_key(contents)
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):  # neither branch of vLLM's union: the errors of both
            if "prompt" in data:
                fields.errors.append(FieldError("string_type", "body.prompt", "Input should be a valid string", prompt))
            else:
                fields.errors.append(FieldError("missing", "body.prompt", "Field required", data))
            fields.errors.append(FieldError("missing", "body.messages", "Field required", data))
        if fields.errors:
            raise validation_error(fields.errors)
        assert isinstance(prompt, str)
        check_model_name(data.get("model"), model)
        require_encodable([prompt])
        count = max(1, count_text_tokens(prompt))
        key = prompt
    ids = prompt_token_ids(key, count)
    return {"count": count, "max_model_len": max_model_len, "tokens": ids, "token_strs": [token_text(i) for i in ids] if strs else None}


def detokenize(headers: Mapping[str, str], body: bytes, *, model: str) -> dict[str, Any]:
    """``/detokenize``'s answer. Raises ApiError: the media type, the JSON, pydantic's errors, the model (404)."""
    require_json_media(headers.get("content-type"))
    data = load_json_object(body)
    fields = Fields(data)
    fields.text("model")
    tokens = data.get("tokens")
    values: list[int | None] = []
    if "tokens" not in data:
        fields.errors.append(FieldError("missing", "body.tokens", "Field required", data))
    elif not isinstance(tokens, list):
        fields.errors.append(FieldError("list_type", "body.tokens", "Input should be a valid list", tokens))
    else:
        ids = Fields({str(index): token for index, token in enumerate(tokens)}, "body.tokens")  # each checked as an int field
        ids.errors = fields.errors
        values = [ids.integer(str(index), None, nullable=False) for index in range(len(tokens))]
        for index, value in enumerate(values):
            if value is not None and value < 0:
                fields.errors.append(
                    FieldError("greater_than_equal", f"body.tokens.{index}", "Input should be greater than or equal to 0", tokens[index], {"ge": 0})
                )
            elif value is not None and value > INT64_MAX:
                fields.errors.append(
                    FieldError("less_than_equal", f"body.tokens.{index}", f"Input should be less than or equal to {INT64_MAX}", tokens[index], {"le": INT64_MAX})
                )
    if fields.errors:
        raise validation_error(fields.errors)
    check_model_name(data.get("model"), model)
    return {"prompt": "".join(token_text(value) for value in values if value is not None)}
