"""Replayed prompts that share what the log says was shared: one text per prefix group, unique filler after it.

An access line names its request's prefix group (``prefix_group``: a digest of
the key tailguard placed it by, router/admission/prefix_keys.py) and what the engine found
cached (``cached_tokens``, vLLM's ``usage.prompt_tokens_details``); no prompt
text. The replay gives each group a deterministic text as long as the group's
shared prefix (the 90th percentile, nearest rank, of its ``cached_tokens``: a
prefix long enough that most warm requests found it, not the one luckiest
hit), and each request that text up to its own prompt length, then a nonce and
filler to its own ``prompt_tokens`` (the simulator's rule, tailguard.sim.tokens:
4 ASCII characters a token), so the virtual engines' prefix caches hit what the
real ones did. Each group's requests also carry the group as
``prompt_cache_key``: tailguard's prefix affinity keeps them on one home as
the real key did, even where that key was a caller's hint and the texts
shared less than the 16 blocks a text key reads.

vLLM leaves ``cached_tokens`` out when nothing was cached, so a null beside
reported values reads as 0; a group where no line reported it at all (the
engine runs without ``--enable-prompt-tokens-details``) shares the assumed
``assume_tokens`` (default 0: nothing). A request without a group is unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tailguard.sim.tokens import ASSISTANT_PRIMING_TOKENS, PER_MESSAGE_TOKENS

from .replay.fleet import Arrival
from .replay.mix import long_document, percentile, request_nonce

SHARE_PERCENTILE = 90  # of a group's cached_tokens: the prefix its requests shared
CHARS_PER_TOKEN = 4  # the simulator's rule for ASCII text
NONCE_SEED = 22  # request_nonce's: unique parts unlike any the fleet's own unique bodies start with
_TEMPLATE_TOKENS = PER_MESSAGE_TOKENS + ASSISTANT_PRIMING_TOKENS  # one user message's chat template


@dataclass(frozen=True)
class Seen:
    """What a log line says of one request's prefix: its group and what the engine found cached."""

    group: str | None = None
    cached: int | None = None  # None: the line did not say


def seen_in(row: dict[str, object]) -> Seen:
    """The prefix fields of an access line or a trace row, where present and well formed."""
    group, cached = row.get("prefix_group"), row.get("cached_tokens")
    return Seen(group if isinstance(group, str) and group else None, cached if isinstance(cached, int) and cached >= 0 else None)


@dataclass(frozen=True)
class Sharing:
    """What the replay modelled of the cache: requests in groups of two or more, and the tokens each group shares."""

    requests: int  # replayed requests, in all
    grouped: int  # of them, in a prefix group of two or more
    shared: int  # of them, in such a group with a shared text (over 0 tokens)
    groups: int  # groups of two or more
    assumed: int  # of them, whose engine reported no cached_tokens (the assumption applied)
    tokens_p50: int  # shared tokens of the median request that shares any (0: none does)

    def summary(self) -> str:
        if not self.grouped:
            return f"Prefix cache: none of the {self.requests} replayed requests shared a prefix group; every prompt is unique."
        return (
            f"Prefix cache: {self.grouped} of {self.requests} replayed requests in {self.groups} prefix groups of two or more, "
            f"{self.shared} with a shared prefix (median {self.tokens_p50} tokens; a group's is the P{SHARE_PERCENTILE} of its "
            f"cached_tokens{f', or the assumed for the {self.assumed} groups that reported none' if self.assumed else ''}); "
            "each group placed as one key."
        )


def shared_tokens(cached: Sequence[int | None], assume: int) -> int:
    """A group's shared prefix: the percentile of its reported ``cached_tokens`` (nulls beside them as 0), else ``assume``."""
    if all(c is None for c in cached):
        return assume
    return int(percentile(sorted(c or 0 for c in cached), SHARE_PERCENTILE))


class _Texts:
    """Prompt texts of exact token lengths: a group's shared head, or a request's unique one, then common filler."""

    def __init__(self, longest_tokens: int) -> None:
        self._filler = long_document(CHARS_PER_TOKEN * longest_tokens + 64)

    def text(self, head: str, tokens: int) -> str:
        chars = CHARS_PER_TOKEN * tokens
        return (head + self._filler[: max(0, chars - len(head))])[:chars]

    @staticmethod
    def group_head(group: str) -> str:
        return f"prefix {group}\n".ljust(24)[:24]  # a whole number of 4-character tokens, unlike any nonce

    def prompt(self, index: int, tokens: int, group: str | None, shared: int) -> str:
        """Request ``index``'s text of ``tokens`` tokens: ``shared`` of them its group's, the rest its own."""
        common = min(shared, tokens) if group is not None else 0
        own = request_nonce(index, seed=NONCE_SEED)
        if common >= tokens:
            return self.text(self.group_head(group or ""), tokens)
        prefix = self.text(self.group_head(group or ""), common) if common else ""
        return prefix + self.text(own, tokens - common)


def with_prefixes(arrivals: Sequence[Arrival], seen: Sequence[Seen], assume: int = 0) -> tuple[list[Arrival], Sharing]:
    """``arrivals`` with texts that share what ``seen`` (one per arrival) says they shared, and what that came to."""
    if len(seen) != len(arrivals):
        raise ValueError(f"{len(seen)} prefix records for {len(arrivals)} arrivals")
    members: dict[str, list[int | None]] = {}
    for s in seen:
        if s.group is not None:
            members.setdefault(s.group, []).append(s.cached)
    groups = {g: cached for g, cached in members.items() if len(cached) > 1}
    shares = {g: shared_tokens(cached, assume) for g, cached in groups.items()}
    texts = _Texts(max((a.prompt_tokens or 0 for a in arrivals), default=0))
    out: list[Arrival] = []
    sharing_tokens: list[int] = []
    for a, s in zip(arrivals, seen):
        group = s.group if s.group in groups else None
        tokens = max(1, (a.prompt_tokens or 0) - _TEMPLATE_TOKENS)
        shared = shares.get(group, 0) if group is not None else 0
        if shared:
            sharing_tokens.append(min(shared, tokens))
        out.append(replace(a, text=texts.prompt(a.index, tokens, group, shared), prefix_hint=group))
    sharing = Sharing(
        requests=len(arrivals),
        grouped=sum(len(c) for c in groups.values()),
        shared=len(sharing_tokens),
        groups=len(groups),
        assumed=sum(1 for c in groups.values() if all(x is None for x in c)),
        tokens_p50=int(percentile(sorted(sharing_tokens), 50)) if sharing_tokens else 0,
    )
    return out, sharing
