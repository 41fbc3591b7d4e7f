"""The simulator's automatic prefix cache: vLLM V1's chained block hashes, ref counts and LRU eviction.

Modelled on vLLM V1's ``KVCacheManager`` and ``BlockPool``
(vllm/v1/core/kv_cache_manager.py, block_pool.py, kv_cache_utils.py): a
prompt's full 16-token blocks are keyed by ``hash(previous key, token ids)``
(the first block's parent mixes in ``cache_salt``), so a block matches only
if every block before it matches; a block a running sequence holds is pinned
(ref-counted); a block whose last holder ends goes to the free queue, still
cached, and the least recently freed goes first when room is needed (a
sequence's blocks are freed tail first, as vLLM does, so its tail goes
before its head).

Capacity is shared with the engine's token accounting: the engine counts the
tokens its running sequences hold (a prefix shared by two running sequences
is counted twice, a simplification) and asks ``make_room`` to evict freed
blocks until held tokens plus cached free blocks fit. Blocks are cached when
the step that computes them in full ends (vLLM caches them when it allocates
them, one step sooner: a same-step twin hits here one step later).

Both engines (``tailguard.sim.Engine`` and the sweep's aggregate
``SweepEngine``) run one admission through this module, so they hit alike:
``lookup`` (how many tokens a waiting sequence may skip), ``admit`` (pin them
and count the lookup as vLLM's ``PrefixCacheStats`` does, preempted
sequences' apart), ``extend`` (pin the blocks a step completed), ``release``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .tokens import prompt_token_array

BLOCK_SIZE = 16  # vLLM's default --block-size on CUDA


def block_hashes(token_ids: Sequence[int] | array[int], cache_salt: str | None = None, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained keys of the full blocks of ``token_ids`` (a partial last block has none)."""
    parent = hashlib.blake2b(("salt:" + (cache_salt or "")).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    keys: list[bytes] = []
    # native 8-byte ints: keys are compared within one process only
    raw = (token_ids if isinstance(token_ids, array) and token_ids.typecode == "q" else array("q", token_ids)).tobytes()
    width = 8 * block_size
    for start in range(0, len(raw) - width + 1, width):
        parent = hashlib.blake2b(parent + raw[start : start + width], digest_size=16).digest()
        keys.append(parent)
    return keys


def prompt_block_keys(prompt_key: str, prompt_tokens: int, cache_salt: str | None = None) -> list[bytes]:
    """The block keys of a prompt text of ``prompt_tokens`` tokens: what both engines look up.

    ``prompt_key`` is the text as the simulator's API builds it (a chat's
    message contents joined by NUL, ``tokens.chat_prompt_key``), so equal text
    prefixes give equal keys whichever engine or caller computes them.
    """
    return block_hashes(prompt_token_array(prompt_key, prompt_tokens), cache_salt)


class PrefixCache:
    """Which full blocks are cached, who holds them, and which free ones go first."""

    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._refs: dict[bytes, int] = {}  # every cached block: its holders (0 = free, in _free)
        self._free: OrderedDict[bytes, None] = OrderedDict()  # least recently freed first
        self.evictions = 0
        self.queries = 0  # prompt tokens looked up at first admission (vllm:prefix_cache_queries)
        self.hits = 0  # of them, found cached (vllm:prefix_cache_hits)
        self.preempted_hits = 0  # tokens preempted sequences found cached again, counted apart as vLLM does

    @property
    def free_cached_blocks(self) -> int:
        """Blocks no running sequence holds that still hold a cached prefix."""
        return len(self._free)

    def match(self, keys: Sequence[bytes], max_tokens: int) -> int:
        """How many leading blocks of ``keys`` are cached, within ``max_tokens`` of hit."""
        limit = min(len(keys), max_tokens // self.block_size)
        hits = 0
        while hits < limit and keys[hits] in self._refs:
            hits += 1
        return hits

    def lookup(self, keys: Sequence[bytes], target_tokens: int) -> int:
        """Tokens a sequence with ``target_tokens`` to compute may skip: its cached whole leading blocks.

        Never the last token: vLLM's ``get_computed_blocks`` stops at
        ``num_tokens - 1`` so the model still computes the logits of the last
        one. No side effect, so a head that does not fit can ask every step.
        """
        return self.match(keys, target_tokens - 1) * self.block_size

    def admit(self, keys: Sequence[bytes], hit_tokens: int, prompt_tokens: int, *, preempted: bool) -> int:
        """Pin the ``hit_tokens`` a sequence now admitted skips and count its lookup; returns the blocks it holds."""
        blocks = hit_tokens // self.block_size
        self.hold(keys[:blocks])
        if preempted:
            self.preempted_hits += hit_tokens
        else:
            self.queries += prompt_tokens
            self.hits += hit_tokens
        return blocks

    def extend(self, keys: Sequence[bytes], held_blocks: int, computed_tokens: int) -> int:
        """Pin the prompt blocks a sequence has now computed in full; returns the blocks it holds."""
        full = min(computed_tokens // self.block_size, len(keys))
        if full > held_blocks:
            self.hold(keys[held_blocks:full])
            return full
        return held_blocks

    def hold(self, keys: Sequence[bytes]) -> None:
        """A sequence holds these blocks (cached now if they were not): pin them."""
        for key in keys:
            refs = self._refs.get(key, 0)
            if refs == 0:
                self._free.pop(key, None)
            self._refs[key] = refs + 1

    def release(self, keys: Sequence[bytes]) -> None:
        """A sequence lets go of these blocks; the last holder's go to the free queue, tail first."""
        for key in reversed(keys):
            refs = self._refs[key] - 1
            self._refs[key] = refs
            if refs == 0:
                self._free[key] = None

    def make_room(self, held_tokens: int) -> None:
        """Evict free blocks, least recently freed first, until they fit beside ``held_tokens``."""
        room = self.capacity_blocks - -(-held_tokens // self.block_size)
        while self._free and len(self._free) > room:
            key, _ = self._free.popitem(last=False)
            del self._refs[key]
            self.evictions += 1

    def cached(self, key: bytes) -> bool:
        """Whether a block is cached (held or free)."""
        return key in self._refs
