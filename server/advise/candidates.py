"""The assignments advise tries: every static split, each under a few lending rules, and the shared pool.

Each candidate is turned into the config the router would run
(``candidate_config``) and the replay's set-up of it (``candidate_setup``);
``shared_setup`` is round robin with no router, the baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tailguard.router.config import AuthConfig, Config, EndpointConfig, LendConfig, PoolConfig

from .fleet import Fleet, PoolPlan
from .replay.mix import CLASSES
from .replay.setups import Setup


@dataclass(frozen=True)
class Candidate:
    """An assignment: engines per pool, what the interactive pool lends to batch, and what batch lends back."""

    interactive: int
    batch: int
    rule: str  # "static", "shared", or which lending rule
    lend: LendConfig = LendConfig()
    lend_back: LendConfig = LendConfig()
    shared: bool = False  # one pool of every engine (the batch pool's tuning), every class in it, short ones first

    @property
    def name(self) -> str:
        return "shared pool" if self.shared else f"{self.interactive}:{self.batch} {self.rule}"

    @property
    def lends(self) -> bool:
        return bool(self.lend.to or self.lend_back.to)


def _scaled(value: int | None, factor: float, floor: int) -> int | None:
    return None if value is None else max(floor, round(value * factor))


Rule = tuple[str, LendConfig, LendConfig]  # label, interactive's lend, batch's lend (back)


def lending_rules(fleet: Fleet, interactive: int) -> list[Rule]:
    """The lending rules tried for a split with ``interactive`` engines in the interactive pool.

    Fractions are of the interactive pool's seats; the prefill budget is
    half the lender's step budget (a borrowed prefill then stalls a step by
    at most half what a full chunk does). One rule also has the batch pool
    lend its idle seats back to interactive requests. The file's own rules
    are scaled from its endpoints to this split's.
    """
    plan, to, back = fleet.interactive, (fleet.batch.config.name,), (fleet.interactive.config.name,)
    seats = plan.seats * interactive
    none = LendConfig()
    one_way = [
        (f"lend {seats // 8}, keep {seats // 2}", LendConfig(to, max_seats=max(1, seats // 8), reserve=seats // 2)),
        (f"lend {seats // 2}, keep {seats // 4}", LendConfig(to, max_seats=max(1, seats // 2), reserve=seats // 4)),
        (
            f"lend {seats // 2}, keep {seats // 4}, prompt <= {plan.params.max_num_batched_tokens // 2}",
            LendConfig(to, max_seats=max(1, seats // 2), reserve=seats // 4, max_prompt_tokens=plan.params.max_num_batched_tokens // 2),
        ),
        ("lend any idle", LendConfig(to)),
    ]
    rules: list[Rule] = [(label, lend, none) for label, lend in one_way]
    rules.append((f"lend any idle, keep {seats // 16}; batch lends back", LendConfig(to, reserve=seats // 16), LendConfig(back)))
    own = (
        _scaled_lend(plan.config.lend, to, interactive, len(plan.config.endpoints), seats),
        _scaled_lend(fleet.batch.config.lend, back, fleet.engines - interactive, len(fleet.batch.config.endpoints), fleet.batch.seats * (fleet.engines - interactive)),
    )
    if (own[0].to or own[1].to) and all((lend, lend_back) != own for _, lend, lend_back in rules):
        rules.append(("config's lend", *own))
    return rules


def _scaled_lend(lend: LendConfig, to: tuple[str, ...], engines: int, file_endpoints: int, seats: int) -> LendConfig:
    """The file's ``lend`` of one pool for ``engines`` engines (seat counts scaled); nothing unless it lends to ``to``."""
    if not set(to) <= set(lend.to):
        return LendConfig()
    factor = engines / max(1, file_endpoints)
    reserve = min(seats - 1, _scaled(lend.reserve, factor, 0) or 0)
    return dataclasses.replace(lend, to=to, max_seats=_scaled(lend.max_seats, factor, 1), reserve=reserve)


def shared_pool(fleet: Fleet) -> Candidate:
    """Every engine in the batch pool with its tuning, both classes in it, the interactive class queued first.

    No split: short requests gain only the queue order, long ones lose
    nothing to a smaller latency engine. On traffic that is mostly long
    (the Mooncake trace, ShareGPT lengths) it is the one layout measured
    never slower than round robin for either class (docs/pools.md).
    """
    return Candidate(0, fleet.engines, "shared", shared=True)


def candidates(fleet: Fleet) -> list[Candidate]:
    """The shared pool, every static split, and every split under every lending rule."""
    found: list[Candidate] = [shared_pool(fleet)]
    for interactive in range(1, fleet.engines):
        batch = fleet.engines - interactive
        found.append(Candidate(interactive, batch, "static"))
        found += [Candidate(interactive, batch, rule, lend, back) for rule, lend, back in lending_rules(fleet, interactive)]
    return found


def stall_ms(fleet: Fleet, candidate: Candidate) -> float:
    """The most one borrowed prefill adds to a step of the lender's engine (0: nothing lent).

    A prefill runs in chunks of at most the engine's step budget, so a
    borrower's prompt over it stalls several steps by the chunk's time each.
    """
    if not candidate.lend.to:
        return 0.0
    params = fleet.interactive.params
    budget = candidate.lend.max_prompt_tokens or params.max_num_batched_tokens
    return min(budget, params.max_num_batched_tokens) / params.prefill_tokens_per_ms


def engine_url(index: int) -> str:
    return f"http://gpu-{index}:8000"


def _pool_config(plan: PoolPlan, urls: Sequence[str], lend: LendConfig) -> PoolConfig:
    return dataclasses.replace(
        plan.config,
        endpoints=tuple(EndpointConfig(url, plan.seats) for url in urls),
        max_concurrency=plan.seats * len(urls),
        max_queue=plan.queue * len(urls),
        lend=lend,
        rebalance="off",
    )


def candidate_config(fleet: Fleet, candidate: Candidate) -> Config:
    """The file's config with its two pools replaced by the candidate's (no auth, nothing movable)."""
    urls = [engine_url(i) for i in range(fleet.engines)]
    if candidate.shared:
        pool = _pool_config(fleet.batch, urls, LendConfig())
        classes = tuple(dataclasses.replace(k, pool=pool.name) for k in fleet.base.classes)
        return dataclasses.replace(fleet.base, pools=(pool,), classes=classes, auth=AuthConfig(), digest="advise")
    pools = (
        _pool_config(fleet.interactive, urls[: candidate.interactive], candidate.lend),
        _pool_config(fleet.batch, urls[candidate.interactive :], candidate.lend_back),
    )
    return dataclasses.replace(fleet.base, pools=pools, auth=AuthConfig(), digest="advise")


def candidate_setup(fleet: Fleet, candidate: Candidate) -> Setup:
    urls = [engine_url(i) for i in range(fleet.engines)]
    engines = tuple((url, fleet.interactive.profile if i < candidate.interactive else fleet.batch.profile) for i, url in enumerate(urls))
    return Setup(candidate.name, engines, config=candidate_config(fleet, candidate), description=candidate.name)


def shared_setup(fleet: Fleet, name: str = "shared round robin") -> Setup:
    """Round robin over every engine, all with the batch pool's profile, no router."""
    urls = tuple(engine_url(i) for i in range(fleet.engines))
    return Setup(name, tuple((url, fleet.batch.profile) for url in urls), direct={kind: urls for kind in CLASSES})
