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

A block is stored once however many sequences hold it, as vLLM's block pool
keeps one physical block with a reference count: ``held_blocks`` counts the
distinct blocks running sequences pin, and the engine's KV in use is its
sequences' private tokens (those past their cached blocks) plus
``held_blocks`` whole blocks. So a prefix shared by 32 running sequences
costs its blocks once, and a waiting sequence's admission pays only for hit
blocks nobody holds (``unheld``: a free cached block leaves the free queue
when it is touched, as vLLM's ``get_num_blocks_to_allocate`` counts
"evictable" hits). The engine asks ``make_room`` to evict freed blocks until
the KV in use plus cached free blocks fit. Blocks are cached when the step
that computes them in full ends (vLLM caches them when it allocates them,
one step sooner: a same-step twin hits here one step later, and until then
holds its own copy; when it completes a block another sequence holds, the
two share it from then on).

Both engines (``tailguard.sim.Engine`` and the sweep's aggregate
``SweepEngine``) run one admission through this module, so they hit alike:
``lookup`` (how many tokens a waiting sequence may skip), ``unheld`` (what
pinning them costs), ``admit`` (pin them and count the lookup as vLLM's
``PrefixCacheStats`` does, preempted sequences' apart), ``extend`` (pin the
blocks a step completed), ``release``; each says how many blocks entered or
left ``held_blocks`` so the engine can keep its KV in use.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .tokens import prompt_token_array

BLOCK_SIZE = 16  # vLLM's default --block-size on CUDA (EngineParams.block_size sets an engine's)


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


def prompt_block_keys(prompt_key: str, prompt_tokens: int, cache_salt: str | None = None, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The block keys of a prompt text of ``prompt_tokens`` tokens: what both engines look up.

    ``prompt_key`` is the text as the simulator's API builds it (a chat's
    message contents joined by NUL, ``tokens.chat_prompt_key``), so equal text
    prefixes give equal keys whichever engine or caller computes them.
    """
    return block_hashes(prompt_token_array(prompt_key, prompt_tokens), cache_salt, block_size)


class PrefixCache:
    """Which full blocks are cached, who holds them, and which free ones go first."""

    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._refs: dict[bytes, int] = {}  # every cached block: its holders (0 = free, in _free)
        self._free: OrderedDict[bytes, None] = OrderedDict()  # least recently freed first
        self.held_blocks = 0  # distinct blocks with holders: in the KV in use once each
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

    def unheld(self, keys: Sequence[bytes]) -> int:
        """How many of these cached blocks no sequence holds: what pinning them adds to the KV in use.

        A hit on a block another running sequence holds costs nothing; a hit
        on a free cached block takes it off the free queue, a block of the
        capacity like any new one (vLLM counts it among the blocks to allocate).
        """
        refs = self._refs
        return sum(1 for key in keys if not refs[key])

    def admit(self, keys: Sequence[bytes], hit_tokens: int, prompt_tokens: int, *, preempted: bool) -> int:
        """Pin the ``hit_tokens`` a sequence now admitted skips and count its lookup; returns the blocks it holds.

        The blocks that enter ``held_blocks`` are the ``unheld`` ones the
        caller asked about before admitting.
        """
        blocks = hit_tokens // self.block_size
        self.hold(keys[:blocks])
        if preempted:
            self.preempted_hits += hit_tokens
        else:
            self.queries += prompt_tokens
            self.hits += hit_tokens
        return blocks

    def extend(self, keys: Sequence[bytes], held_blocks: int, computed_tokens: int) -> tuple[int, int]:
        """Pin the prompt blocks a sequence has now computed in full.

        Returns the blocks it holds and how many of the new ones entered
        ``held_blocks`` (fewer than it pinned when a twin holds some already:
        from now on they share one copy).
        """
        full = min(computed_tokens // self.block_size, len(keys))
        if full > held_blocks:
            return full, self.hold(keys[held_blocks:full])
        return held_blocks, 0

    def hold(self, keys: Sequence[bytes]) -> int:
        """A sequence holds these blocks (cached now if they were not): pin them; returns how many nobody held."""
        entered = 0
        refs_of, free = self._refs, self._free
        for key in keys:
            refs = refs_of.get(key, 0)
            if refs == 0:
                free.pop(key, None)
                entered += 1
            refs_of[key] = refs + 1
        self.held_blocks += entered
        return entered

    def release(self, keys: Sequence[bytes]) -> int:
        """A sequence lets go of these blocks; the last holder's go to the free queue, tail first.

        Returns how many left ``held_blocks`` (those it was the last to hold).
        """
        left = 0
        refs_of, free = self._refs, self._free
        for key in reversed(keys):
            refs = refs_of[key] - 1
            refs_of[key] = refs
            if refs == 0:
                free[key] = None
                left += 1
        self.held_blocks -= left
        return left

    def make_room(self, held_tokens: int) -> None:
        """Evict free blocks, least recently freed first, until they fit beside ``held_tokens`` (the KV in use)."""
        room = self.capacity_blocks - -(-held_tokens // self.block_size)
        while self._free and len(self._free) > room:
            key, _ = self._free.popitem(last=False)
            del self._refs[key]
            self.evictions += 1

    def cached(self, key: bytes) -> bool:
        """Whether a block is cached (held or free)."""
        return key in self._refs
