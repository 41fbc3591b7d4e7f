"""Log probabilities for the simulator's tokens, in the two shapes vLLM 0.32 answers them.

The simulator has no model, so its logprobs are a fixed function of the
token and its position (the same output gives the same numbers), shaped as
vLLM's serving code shapes them:

- completions (``logprobs: k``): ``{"text_offset", "token_logprobs",
  "tokens", "top_logprobs"}``, each top entry a dict of the sampled token
  and ``k`` others (vLLM's sampler returns the sampled token beside the top
  k); offsets count characters of the output, and continue across a
  stream's events;
- chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [k entries, the sampled token
  first]}]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .tokens import TOKEN_TEXT, VOCABULARY_SIZE

_ALTERNATIVE_STRIDE = 7919  # a prime: the k alternatives of a token are distinct and never the token itself


def token_logprob(token_id: int, position: int) -> float:
    """The sampled token's log probability: a fixed number in [-4.5, -0.5)."""
    return -0.5 - ((token_id * 2654435761 + position * 40503) % 1000) / 250


def _alternatives(token_id: int, position: int, count: int) -> list[tuple[int, float]]:
    base = token_logprob(token_id, position)
    return [((token_id + j * _ALTERNATIVE_STRIDE) % VOCABULARY_SIZE, base - 0.25 * j) for j in range(1, count + 1)]


def completion_logprobs(token_ids: Sequence[int], first_position: int, offset: int, top: int) -> tuple[dict[str, Any], int]:
    """A completion choice's ``logprobs`` for these tokens, and the text offset after them."""
    offsets: list[int] = []
    logprobs: list[float] = []
    texts: list[str] = []
    tops: list[dict[str, float]] = []
    for n, token in enumerate(token_ids):
        position = first_position + n
        text = TOKEN_TEXT[token]
        offsets.append(offset)
        offset += len(text)
        value = token_logprob(token, position)
        logprobs.append(value)
        texts.append(text)
        entry = {text: value}
        for other, other_value in _alternatives(token, position, top):
            entry.setdefault(TOKEN_TEXT[other], other_value)
        tops.append(entry)
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": texts, "top_logprobs": tops}, offset


def chat_logprobs(token_ids: Sequence[int], first_position: int, top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for these tokens."""
    content = []
    for n, token in enumerate(token_ids):
        position = first_position + n
        value = token_logprob(token, position)
        ranked = [(token, value), *_alternatives(token, position, max(0, top - 1))][:top]
        content.append({**_chat_entry(token, value), "top_logprobs": [_chat_entry(t, v) for t, v in ranked]})
    return {"content": content}


def _chat_entry(token: int, value: float) -> dict[str, Any]:
    text = TOKEN_TEXT[token]
    return {"token": text, "logprob": value, "bytes": list(text.encode())}


def responses_logprobs(token_ids: Sequence[int], first_position: int, top: int, *, stream: bool = False) -> list[dict[str, Any]]:
    """A Responses API ``output_text``'s ``logprobs`` for these tokens: ``{"token", "bytes", "logprob", "top_logprobs"}``
    each, ``top`` entries the sampled token first; a stream's ``output_text.delta`` leaves ``bytes`` out, as vLLM does."""
    entries = []
    for n, token in enumerate(token_ids):
        position = first_position + n
        value = token_logprob(token, position)
        ranked = [(token, value), *_alternatives(token, position, max(0, top - 1))][:top]
        entries.append({**_responses_entry(token, value, stream), "top_logprobs": [_responses_entry(t, v, stream) for t, v in ranked]})
    return entries


def _responses_entry(token: int, value: float, stream: bool) -> dict[str, Any]:
    text = TOKEN_TEXT[token]
    if stream:
        return {"token": text, "logprob": value}
    return {"token": text, "bytes": list(text.encode()), "logprob": value}
