"""The Mooncake replay's prompts, built from ``hash_ids``: equal ids give equal text and shared cache blocks."""

from __future__ import annotations

from collections.abc import Sequence

from tailguard.sim.tokens import count_chat_tokens

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids each name a block of 512 tokens
TEMPLATE_TOKENS = count_chat_tokens([""])  # one user message's template tokens (7)


def block_text(hash_id: int) -> str:
    """The text of one trace block: 512 tokens of 4 characters each, distinct for every id."""
    return f"{hash_id:07x} " * (TRACE_BLOCK_TOKENS // 2)


def prompt_text(hash_ids: Sequence[int], input_length: int) -> str:
    """A one-message chat prompt of ``input_length`` tokens built from its blocks, so equal ids give equal text.

    Every block's 2,048 characters start at a multiple of 512 tokens, so a
    trace block is exactly 32 of the simulator's 16-token blocks and two
    prompts that share leading ids share those cache blocks.
    """
    chars = 4 * max(1, input_length - TEMPLATE_TOKENS)
    text = "".join(block_text(h) for h in hash_ids)[:chars]
    return text + "x" * (chars - len(text))  # fewer ids than blocks (never in the Mooncake trace): filler
