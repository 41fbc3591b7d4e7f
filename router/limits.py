"""Size estimate and caps: the first, cheapest line of defence for the tail.

The estimate is a heuristic, CJK-aware (a CJK character is about a token;
other text about ``chars_per_token`` characters a token). It is meant to be
cheap and a little pessimistic, not exact: the backend's tokenizer is the
truth, and vLLM still refuses what does not fit.
"""

from __future__ import annotations

import math
import re

from .config_types import EstimateConfig, LimitsConfig
from .errors import MaxTokensTooLarge, PromptTooLong
from .request import RouterRequest

_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0002fa1f]"
)


def estimate_text_tokens(text: str, estimate: EstimateConfig) -> int:
    """Estimated tokens of one text."""
    if text.isascii():
        return math.ceil(len(text) / estimate.chars_per_token)
    cjk = len(_CJK.findall(text))
    other = len(text) - cjk
    return math.ceil(cjk / estimate.cjk_chars_per_token + other / estimate.chars_per_token)


def estimate_prompt_tokens(request: RouterRequest, estimate: EstimateConfig) -> int:
    """Estimated prompt tokens of a request, chat template overhead included."""
    tokens = sum(estimate_text_tokens(text, estimate) for text in request.texts())
    if request.kind == "chat":
        tokens += estimate.per_message_tokens * len(request.messages or ())
    return max(1, tokens + request.prompt_token_ids())


def check_prompt(prompt_tokens: int, limits: LimitsConfig) -> None:
    """Raise PromptTooLong when the estimate is over the input cap."""
    if prompt_tokens > limits.input_cap_tokens:
        raise PromptTooLong(
            f"the prompt is about {prompt_tokens} tokens, over this service's input cap of "
            f"{limits.input_cap_tokens} tokens; shorten it or split the document",
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


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, pool: str) -> None:
    """Raise PromptTooLong when prompt + max_tokens cannot fit the pool's model."""
    if prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLong(
            f"the prompt (about {prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"{max_model_len}-token context of the models in pool {pool!r}; lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
