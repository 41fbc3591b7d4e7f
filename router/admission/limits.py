"""Caps on a request's size: the first, cheapest line of defence for the tail.

The prompt's size is the estimate's (router/admission/estimate.py), corrected by what
each model's engines taught (router/admission/prompt_ratios.py); the caps here only
compare numbers and raise the error the caller is answered with.
"""

from __future__ import annotations

from ..config import LimitsConfig
from ..errors import InvalidRequest, MaxTokensTooLarge, PromptTooLong


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
