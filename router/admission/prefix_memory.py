"""Which engine holds a conversation's history warm, so its next turn is classified by the tokens left to prefill.

Turn n of a chat resends every earlier message; by raw length it soon
crosses an interactive class's prompt bound, although on the engine that
served turn n-1 only the last answer and question need prefill (vLLM's
prefix cache holds the rest). A class with ``prompt_bound = "uncached"``
bounds that remainder instead of the whole prompt.

The router cannot see an engine's cache, so it remembers what it sent:
when a chat request ends well, the digest of its whole message list maps
to the endpoint that served it and its prompt's tokens. The next turn's
messages, less its last two (the answer received and the new question),
digest to the same key; if that endpoint is still the turn's prefix home,
its expected uncached tokens are the difference. Anything the router cannot
know -- a completion prompt, a first turn, a history it never served, an
endpoint gone, ejected or no longer the home -- counts every token.

Per process and bounded (least recently used entries go first): a replica
or worker that never served a conversation counts all its tokens, which is
the safe side. Hashing is blake2b over the messages' roles and texts,
incremental, so the three digests a request needs cost one pass over its
text (~0.1 ms for a 32k-token chat); it runs only where some class asks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .request import message_text

DEFAULT_CAPACITY = 65_536  # conversations remembered per process (~10 MiB)
_ROLE_END = b"\x1e"
_MESSAGE_END = b"\x1f"


@dataclass(frozen=True)
class Warm:
    """An endpoint expected to hold a history's KV blocks, and how many prompt tokens they cover."""

    endpoint_url: str
    tokens: int


@dataclass(frozen=True)
class HistoryDigests:
    """The digests of one chat request's message list: its own, and those its earlier turn would have had."""

    whole: bytes  # every message: what the next turn looks up once this one is answered
    earlier: tuple[bytes, ...]  # all but the last two, then all but the last: an earlier turn's whole list


def history_digests(messages: Sequence[Mapping[str, Any]] | None) -> HistoryDigests | None:
    """The digests of a chat's message list, or None for a completion or an empty chat."""
    if not messages:
        return None
    count = len(messages)
    digest = hashlib.blake2b(digest_size=16)
    earlier: list[bytes] = []
    for index, message in enumerate(messages):
        if index in (count - 2, count - 1) and index > 0:
            earlier.append(digest.copy().digest())  # the messages before this one
        digest.update(str(message.get("role", "")).encode("utf-8", "surrogatepass") + _ROLE_END)
        digest.update(message_text(message).encode("utf-8", "surrogatepass") + _MESSAGE_END)
    return HistoryDigests(whole=digest.digest(), earlier=tuple(earlier))


class ConversationMemory:
    """Histories this process served, by digest: where each is warm (least recently used forgotten first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"the memory must hold at least one conversation, not {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Warm] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, digest: bytes, endpoint_url: str, tokens: int) -> None:
        """A request with this history was answered by ``endpoint_url``, its prompt ``tokens`` long."""
        self._entries[digest] = Warm(endpoint_url, tokens)
        self._entries.move_to_end(digest)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def warm(self, digests: HistoryDigests) -> Warm | None:
        """The longest earlier turn of this history the process served, or None."""
        found: Warm | None = None
        for digest in digests.earlier:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
                if found is None or entry.tokens > found.tokens:
                    found = entry
        return found


def uncached_tokens(prompt_tokens: int, warm: Warm | None) -> int:
    """The prompt tokens left to prefill on the warm endpoint (at least one: vLLM always computes the last)."""
    if warm is None:
        return prompt_tokens
    return max(1, prompt_tokens - warm.tokens)
