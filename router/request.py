"""The router's own request and routing records: no wire format, only meaning.

Front ends translate their wire request (OpenAI JSON, protobuf) into a
:class:`RouterRequest`; the router answers with a :class:`Routing` record of
the decisions it took, which front ends report back (headers, metadata).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import InvalidRequest

RequestKind = Literal["chat", "completion"]

# Far above any real context window, far below what breaks JSON integers.
MAX_TOKENS_CEILING = 1 << 31


@dataclass(frozen=True)
class RouterRequest:
    """One completion request, as the core sees it.

    ``params`` holds every backend parameter the router does not interpret
    (``temperature``, ``top_k``, ``guided_json``, ``logprobs``, ...); it is
    sent to the backend untouched. ``deadline`` is the caller's own absolute
    Trio deadline (a gRPC deadline), if it has one.
    """

    kind: RequestKind
    request_id: str
    model: str | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | Sequence[str] | Sequence[int] | None = None
    max_tokens: int | None = None
    stream: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    caller: str | None = None
    forced_class: str | None = None
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "chat":
            _check_messages(self.messages)
        else:
            _check_prompt(self.prompt)
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise InvalidRequest("max_tokens must be an integer", param="max_tokens")
            if not 1 <= self.max_tokens < MAX_TOKENS_CEILING:
                raise InvalidRequest(
                    f"max_tokens must be between 1 and {MAX_TOKENS_CEILING - 1}, got {self.max_tokens}",
                    param="max_tokens",
                )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise InvalidRequest("model must be a non-empty string", param="model")

    def texts(self) -> list[str]:
        """The prompt's texts, for size estimation (chat: one per message)."""
        if self.kind == "chat":
            return [message_text(m) for m in self.messages or ()]
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return [str(p) for p in prompt]
        return []

    def prompt_token_ids(self) -> int:
        """How many token ids the prompt gives directly (a list of ints), else 0."""
        prompt = self.prompt
        if self.kind == "completion" and isinstance(prompt, Sequence) and not isinstance(prompt, str):
            if prompt and isinstance(prompt[0], int):
                return len(prompt)
        return 0


@dataclass(frozen=True)
class Routing:
    """What the router decided for a request; front ends report it to the caller."""

    request_id: str
    request_class: str
    pool: str
    endpoint: str
    prompt_tokens: int  # estimated
    requested_max_tokens: int | None
    max_tokens: int  # effective, sent to the backend
    clamped: bool
    queue_seconds: float


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one chat message: a string, or the text parts of a list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return ""


def _check_messages(messages: object) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages must be a non-empty list of messages", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{index}] must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}].role must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"messages[{index}].content must be a string or a list of parts", param="messages")


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, Sequence) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return
    raise InvalidRequest("prompt must be a string, a list of strings, or a list of token ids", param="prompt")
