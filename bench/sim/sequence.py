"""One request inside the simulated engine (``Sequence``): its progress, its output, its timings, and a parking lot its readers wait on.

The underscored fields are the engine's bookkeeping (prefill progress, KV
and prefix-cache blocks held, arrival order): ``engine.Engine`` alone
reads and writes them; everyone else reads the public fields and waits.
"""

from __future__ import annotations

import random

import trio


class Sequence:
    """One request inside the engine: its progress, its output, its timings.

    Timestamps are raw Trio times; divide intervals by the engine's
    ``time_scale`` to get the GPU's own (unscaled) view.
    """

    __slots__ = (
        "request_id",
        "prompt_tokens",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "arrival",
        "scheduled_at",
        "first_token_at",
        "last_token_at",
        "finished_at",
        "finish_reason",
        "token_ids",
        "preemptions",
        "priority",
        "cached_tokens",
        "prefill_only",
        "_rng",
        "_prefill_target",
        "_computed",
        "_kv_held",
        "_arrival_seq",
        "_lot",
        "_block_keys",
        "_blocks_held",
    )

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        rng: random.Random,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        priority: int = 0,
        arrival: float,
        arrival_seq: int,
        prefill_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.arrival = arrival
        self.scheduled_at: float | None = None  # first admitted to the running batch (vLLM's first SCHEDULED event)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.preemptions = 0
        self.priority = priority  # vLLM's request priority: lower runs first (priority policy only)
        # Prompt tokens found in the prefix cache at first admission (vLLM's num_cached_tokens).
        self.cached_tokens = 0
        # A pooling request (an embedding, a rerank's text): its prompt is prefilled, and it ends then, with no token.
        self.prefill_only = prefill_only
        self._block_keys: list[bytes] = []  # the prompt's full blocks' chained keys (prefix caching only)
        self._blocks_held = 0  # how many leading keys this sequence pins in the cache
        self._rng = rng
        self._prefill_target = prompt_tokens
        self._computed = 0
        self._kv_held = 0
        self._arrival_seq = arrival_seq
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def wait_for_tokens(self, seen: int) -> None:
        """Return once there are more than ``seen`` tokens or the sequence ended."""
        while len(self.token_ids) <= seen and self.finish_reason is None:
            await self._lot.park()

    async def wait_finished(self) -> None:
        """Return once the sequence has ended (finished or aborted)."""
        while self.finish_reason is None:
            await self._lot.park()

    def _wake(self) -> None:
        if self._lot:
            self._lot.unpark_all()
