"""The tenants' arrivals: B steady (Poisson), A in bursts (Poisson while on, nothing while off), merged in time order."""

from __future__ import annotations

from collections.abc import Callable

from bench.harness.short_chat import PROMPT_TOKENS, max_tokens_draws
from bench.harness.traffic import poisson_offsets
from bench.harness.unique import run_seed
from bench.tenants.model import Options
from tailguard.server.advise.replay.trace import Arrival


def bursting(offsets: list[float], on: float, off: float) -> list[float]:
    """The offsets that fall in an on-phase of the cycle ``on`` s on, ``off`` s off, starting on at 0."""
    period = on + off
    return [t for t in offsets if t % period < on]


def arrivals(options: Options, with_a: bool) -> list[Arrival]:
    """B at ``b_load`` of the capacity, and A at ``a_burst`` times it in bursts when ``with_a``; each tenant seeded apart."""
    horizon = options.horizon
    timed = [(t, "B") for t in poisson_offsets(options.b_load * options.capacity, horizon, run_seed(options.seed, "B"))]
    if with_a:
        offered = poisson_offsets(options.a_burst * options.capacity, horizon, run_seed(options.seed, "A"))
        timed += [(t, "A") for t in bursting(offered, options.burst_on, options.burst_off)]
    timed.sort()
    lengths = {tenant: max_tokens(options.seed, tenant) for tenant in ("A", "B")}
    return [Arrival(t, tenant, PROMPT_TOKENS, lengths[tenant](), t >= options.warmup) for t, tenant in timed]


def max_tokens(seed: int, tenant: str) -> Callable[[], int]:
    """A tenant's draws of max_tokens, uniform over MAX_TOKENS (seeded apart from its arrival times)."""
    return max_tokens_draws(run_seed(seed, tenant, "max_tokens"))
