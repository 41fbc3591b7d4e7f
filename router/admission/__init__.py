"""What a request is and the decision on it: caps, its size estimate, its class and prefix."""

from __future__ import annotations

from .admit import Admitted as Admitted, classify as classify, decide as decide
from .cache_salt import caller_salt as caller_salt
from .estimate import (
    KINDS as KINDS,
    PromptSize as PromptSize,
    estimate_prompt_tokens as estimate_prompt_tokens,
    estimate_text_tokens as estimate_text_tokens,
    size_prompt as size_prompt,
)
from .limits import check_prompt as check_prompt, effective_max_tokens as effective_max_tokens
from .prefix_keys import key_chars as key_chars, prefix_key as prefix_key, prefix_key_of as prefix_key_of
from .prefix_memory import (
    ConversationMemory as ConversationMemory,
    HistoryDigests as HistoryDigests,
    Warm as Warm,
    history_digests as history_digests,
    uncached_tokens as uncached_tokens,
)
from .prompt_ratios import KindRatio as KindRatio, PromptRatios as PromptRatios
from .request import (
    MAX_JSON_DEPTH as MAX_JSON_DEPTH,
    MAX_TOKENS_FIELD as MAX_TOKENS_FIELD,
    MESSAGE_KINDS as MESSAGE_KINDS,
    POOLING as POOLING,
    RequestKind as RequestKind,
    RouterRequest as RouterRequest,
    Routing as Routing,
    message_text as message_text,
)
