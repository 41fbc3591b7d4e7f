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
blocks until held tokens plus cached free blocks fit.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16  # vLLM's default --block-size on CUDA


def block_hashes(token_ids: Sequence[int], cache_salt: str | None = None, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained keys of the full blocks of ``token_ids`` (a partial last block has none)."""
    parent = hashlib.blake2b(("salt:" + (cache_salt or "")).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    keys: list[bytes] = []
    raw = array("q", token_ids).tobytes()  # native 8-byte ints: keys are compared within one process only
    width = 8 * block_size
    for start in range(0, len(raw) - width + 1, width):
        parent = hashlib.blake2b(parent + raw[start : start + width], digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Which full blocks are cached, who holds them, and which free ones go first."""

    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._refs: dict[bytes, int] = {}  # every cached block: its holders (0 = free, in _free)
        self._free: OrderedDict[bytes, None] = OrderedDict()  # least recently freed first
        self.evictions = 0

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
