"""The prefix key of a request: a stable hash of its prompt's leading blocks, or of the caller's hint.

Requests whose prompts start alike share an engine's prefix cache, so
placement sends equal keys to the same engine (policies.PrefixAffinity).
Only the leading characters the key covers are read and hashed, once per
request: the cost does not grow with the prompt. The hash is blake2b,
never Python's salted ``hash()``: every worker and replica computes the
same key for the same prompt.

A caller's hint pins a conversation's key whatever its text: OpenAI's
``prompt_cache_key``, then ``user``, then a session header's value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import RouterRequest

KEY_BYTES = 16
BLOCK_TOKENS = 16  # vLLM's default KV-cache block size
DEFAULT_BLOCKS = 16  # leading blocks the key covers: 256 tokens
CHARS_PER_TOKEN = 4  # the estimate's default (config_types: chars_per_token)

# Domain tags: a hint never equals a prompt's text key, nor a hint of another kind.
_TEXT = b"t"
_HINTS = (("prompt_cache_key", b"p"), ("user", b"u"))
_SESSION = b"s"
_ROLE_END = "\x1e"  # between a message's role and its content
_MESSAGE_END = "\x1f"  # after a message's content


def key_chars(blocks: int = DEFAULT_BLOCKS) -> int:
    """Leading characters of the prompt the key covers: ``blocks`` blocks' estimated worth."""
    return blocks * BLOCK_TOKENS * CHARS_PER_TOKEN


def prefix_key(body: Mapping[str, object], session: str | None = None, *, chars: int = key_chars()) -> bytes | None:
    """The request's key, or None where it has no prompt text and no hint.

    ``body`` is the parsed OpenAI request (chat or completion), ``session``
    a session header's value if the request carried one.
    """
    messages = body.get("messages")
    return _key(body, session, messages if isinstance(messages, list) else None, body.get("prompt"), chars)


GROUP_BYTES = 8  # of a key, in the access log's prefix_group


def prefix_group(key: bytes | None) -> str | None:
    """A key's first bytes in hex, for the access log: requests that shared a prefix (or hint) share it; it reads no text."""
    return None if key is None else key[:GROUP_BYTES].hex()


def prefix_key_of(request: RouterRequest, blocks: int = DEFAULT_BLOCKS) -> bytes | None:
    """The key of a translated request (either front end): its hints in ``params``, its session, its prompt's first ``blocks`` blocks."""
    return _key(request.params, request.session, request.conversation(), request.prompt, key_chars(blocks))


def _key(hints: Mapping[str, object], session: str | None, messages: object, prompt: object, chars: int) -> bytes | None:
    for field, tag in _HINTS:
        hint = hints.get(field)
        if isinstance(hint, str) and hint:
            return _digest(tag, hint)
    if session:
        return _digest(_SESSION, session)
    text = _leading(_pieces(messages, prompt, chars), chars)
    return _digest(_TEXT, text) if text else None


def leading_text(body: Mapping[str, object], chars: int) -> str:
    """The first ``chars`` characters of the prompt: chat messages in order with their roles, or the completion prompt."""
    messages = body.get("messages")
    return _leading(_pieces(messages if isinstance(messages, list) else None, body.get("prompt"), chars), chars)


def _leading(pieces: Iterator[str], chars: int) -> str:
    """The first ``chars`` characters of ``pieces`` joined, reading no piece past them."""
    taken: list[str] = []
    left = chars
    for piece in pieces:
        if left <= 0:
            break
        taken.append(piece[:left])
        left -= len(piece)
    return "".join(taken)


def _pieces(messages: object, prompt: object, chars: int) -> Iterator[str]:
    """The prompt's text in order (chat ``messages`` if any, else the completion ``prompt``), lazily: the caller stops once it has enough."""
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        for message in messages:
            if isinstance(message, Mapping):
                yield from _message_pieces(message)
        return
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, Sequence):  # token ids: the tokens the key covers, one character each
        yield _spelled(prompt[: chars // CHARS_PER_TOKEN])


def _spelled(tokens: Sequence[Any]) -> str:
    """Token ids as one character each (a vocabulary fits in Unicode's range); odd ones spelled out."""
    try:
        return "".join(map(chr, tokens))  # a non-int raises TypeError: spelled below
    except (TypeError, ValueError, OverflowError):
        return " ".join(map(str, tokens))


def _message_pieces(message: Mapping[str, object]) -> Iterator[str]:
    """One chat message: its role, then its text (a string, or the text of its parts)."""
    yield str(message.get("role", "")) + _ROLE_END
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    yield text
    yield _MESSAGE_END


def _digest(tag: bytes, text: str) -> bytes:
    return hashlib.blake2b(tag + text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES).digest()
