"""A pool's ``max_model_len`` asked of its engines when the config leaves it out.

vLLM reports its ``--max-model-len`` in ``GET /v1/models`` (every served
model's object carries ``max_model_len``), so writing it into
``config.toml`` as well is one more number to keep equal by hand. A pool
without it gets, at start and on every reload, the smallest value its
endpoints report (asked at once, each bounded by ``timeouts.connect_timeout
+ timeouts.health_check_timeout``), with a warning when they disagree; the
input cap check (``max_model_len > limits.input_cap_tokens``) runs on that
value as on a written one. A pool none of whose endpoints answers, and which
has no written value, is refused: the process does not start (one line,
exit 2), a reload keeps the running config.

A written value stays an override: nobody is asked, and the operator's word
covers every endpoint of the pool.

The value is never exceeded silently by an endpoint that was not asked:
under a discovered value an endpoint serves the pool only once it has
reported at least that value (:func:`context_fits`). One that did not
answer at start, a new address from DNS, an endpoint moved in by
rebalancing: each is kept out (``/health`` shows it ``unverified``) until the
health check, which asks every such endpoint again each turn, hears enough.
One that reports less stays out, with a warning naming both numbers; the
pool's value is never lowered behind the operator's back (a reload asks
everyone again, and may lower it then). Rebalancing never picks a move into a
pool whose value the endpoint does not reach.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import trio

from ..backend import BackendProbe, ModelLenUnknown
from ..config import Config, EndpointConfig, PoolConfig, max_model_len_problem
from .discovery import resolve_once

__all__ = ["Asked", "ModelLenError", "ask_model_lens", "ask_timeout", "context_fits"]

log = logging.getLogger("tailguard.model_len")


class ModelLenError(Exception):
    """Pools whose ``max_model_len`` is neither written nor learnt; one problem per pool, on one line."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Asked:
    """What one round of asking gives: the config with every pool's value filled in, and each answer.

    ``reported`` maps every endpoint URL asked to the value it reported, or
    None when it did not answer (it then serves no pool whose value was
    discovered, until it does).
    """

    config: Config
    reported: dict[str, int | None]


def ask_timeout(config: Config) -> float:
    """How long one endpoint is given to answer: a connection, then an answer as quick as a health check's."""
    return config.timeouts.connect_timeout + config.timeouts.health_check_timeout


def context_fits(reported: int | None, pool: PoolConfig) -> bool:
    """Whether an endpoint that reported ``reported`` (None: nothing) may take ``pool``'s requests."""
    if pool.max_model_len_configured:
        return True  # the operator's value is the override
    return reported is not None and reported >= pool.max_model_len


async def ask_model_lens(config: Config) -> Asked:
    """Fill in every pool's ``max_model_len`` the file left out, from its endpoints.

    Asks each endpoint of those pools (its static ones and its DNS names'
    addresses now) and, when such a pool may take endpoints by rebalancing,
    every movable endpoint too; all at once, each bounded by
    :func:`ask_timeout`. Nothing is asked when every pool has its value.
    Raises :exc:`ModelLenError` for pools none of whose endpoints answered,
    or whose smallest value cannot hold ``limits.input_cap_tokens``.
    """
    open_pools = [pool for pool in config.pools if not pool.max_model_len_configured]
    if not open_pools:
        return Asked(config, {})
    names = {source.name for pool in open_pools for source in pool.endpoints_dns}
    resolved = await resolve_once(config.discovery, names) if names else {}
    members = {
        pool.name: [*pool.endpoints, *(source.endpoint(a) for source in pool.endpoints_dns for a in resolved.get(source.name, ()))]
        for pool in open_pools
    }
    movable = [e for pool in config.pools for e in pool.endpoints if e.movable] if any(p.rebalance == "auto" for p in open_pools) else []
    to_ask = {e.url: e for e in [*(e for group in members.values() for e in group), *movable]}
    answers = await _ask_all(to_ask.values(), config)

    problems: list[str] = []
    pools: dict[str, PoolConfig] = {}
    for pool in open_pools:
        key = f"pools.{pool.name}.max_model_len"
        got = {e.url: answers[e.url] for e in members[pool.name]}
        values = {url: v for url, v in got.items() if isinstance(v, int)}
        silent = {url: why for url, why in got.items() if isinstance(why, str)}
        if not values:
            why = ", ".join(f"{url}: {reason}" for url, reason in silent.items()) or "it has no endpoint to ask"
            problems.append(
                f"{key} is not set and no endpoint of pool {pool.name} reported one in GET /v1/models ({why});"
                " set it in the config, or start the engines first"
            )
            continue
        value = min(values.values())
        if len(set(values.values())) > 1:
            log.warning(
                "pool %s: its endpoints report different max_model_len (%s); the pool uses the smallest, %d",
                pool.name, ", ".join(f"{url} {v}" for url, v in values.items()), value,
            )
        if silent:
            log.warning(
                "pool %s: %s did not report a max_model_len (%s); each takes none of the pool's requests"
                " until it reports at least %d (asked again at every health check)",
                pool.name, ", ".join(silent), "; ".join(silent.values()), value,
            )
        problem = max_model_len_problem(value, config.limits.input_cap_tokens)
        if problem is not None:
            problems.append(f"{key} (as pool {pool.name}'s endpoints report it): {problem}")
            continue
        log.info("pool %s: max_model_len %d, as its endpoints report it (%d of %d answered)", pool.name, value, len(values), len(got))
        pools[pool.name] = dataclasses.replace(pool, max_model_len=value)
    for pool in config.pools:
        for endpoint in pool.endpoints if pool.max_model_len_configured else ():
            reported = answers.get(endpoint.url)
            if isinstance(reported, int) and reported < pool.max_model_len:
                log.warning(
                    "pool %s: max_model_len = %d is set, but %s reports %d: requests longer than that will be refused by the engine",
                    pool.name, pool.max_model_len, endpoint.url, reported,
                )
    if problems:
        raise ModelLenError(problems)
    filled = tuple(pools.get(pool.name, pool) for pool in config.pools)
    return Asked(dataclasses.replace(config, pools=filled), {url: v if isinstance(v, int) else None for url, v in answers.items()})


async def _ask_all(endpoints: Iterable[EndpointConfig], config: Config) -> dict[str, int | str]:
    """Each endpoint's ``max_model_len``, or why there is none; all asked at once."""
    timeout = ask_timeout(config)
    answers: dict[str, int | str] = {}

    async def ask(endpoint: EndpointConfig) -> None:
        url = endpoint.url
        answers[url] = f"no answer in {timeout:g} s"
        probe = BackendProbe(url, connect_timeout=config.timeouts.connect_timeout, access=endpoint.access)  # vLLM's --api-key guards /v1/models
        try:
            with trio.move_on_after(timeout):
                try:
                    answers[url] = await probe.max_model_len()
                except ModelLenUnknown as error:
                    answers[url] = str(error)
        finally:
            with trio.CancelScope(shield=True):
                await probe.aclose()

    async with trio.open_nursery() as nursery:
        for endpoint in endpoints:
            nursery.start_soon(ask, endpoint)
    return answers
