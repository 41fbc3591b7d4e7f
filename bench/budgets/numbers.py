"""A run's numbers from its requests: the fleet's most tokens in a minute against the target, per phase, per 10 s, the 429s.

"Admitted" is what the client saw: each 200's usage, at the time it was
sent (the router counts a request at its admission: milliseconds after, or
as late as the class's queue_timeout for one that waited for a grant; the
report's answer times show how long the 200s waited). A request
that got no answer (its replica killed under it, or the run's bound) may
have been admitted too: the upper figure counts each at its reservation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.budgets.drive import Driven
from bench.budgets.model import Options, Sent, Trail, phases, replica_name
from bench.budgets.windows import Event, binned, per_minute, sliding_max, static_share_rate, stepped_sums, within_target
from tailguard.server.advise.replay.mix import percentile

BIN_S = 10.0

BUDGET_CODE = "token_budget_exceeded"


@dataclass(frozen=True)
class Verdict:
    """The target: the most tokens admitted fleet-wide in any 60 s, against the budget and one largest request."""

    budget: int
    largest: int  # the largest 200's usage
    bound: int
    most: int  # exact: over every window position
    most_at: float  # where that window starts, s
    most_stepped: int  # over windows ending on whole seconds
    most_with_unanswered: int  # with every request that got no answer counted at its reservation
    met: bool


def admitted(sent: Sequence[Sent], replica: str | None = None) -> list[Event]:
    return [(s.sent, s.tokens) for s in sent if s.status == 200 and (replica is None or s.replica == replica)]


def offered(sent: Sequence[Sent], replica: str | None = None) -> list[Event]:
    """Every request sent, at its reservation: what the clients asked for."""
    return [(s.sent, s.reserve) for s in sent if not math.isnan(s.sent) and (replica is None or s.replica == replica)]


def unanswered(sent: Sequence[Sent]) -> list[Event]:
    return [(s.sent, s.reserve) for s in sent if s.status == 0 and not math.isnan(s.sent)]


def outcome(s: Sent) -> str:
    if s.status == 0:
        return f"no answer ({s.code})" if s.code else "cut"
    return "200" if s.status == 200 else f"{s.status} {s.code}"


def verdict(sent: Sequence[Sent], budget: int, until: float) -> Verdict:
    events = admitted(sent)
    largest = max((tokens for _, tokens in events), default=0)
    most = sliding_max(events)
    stepped = max((total for _, total in stepped_sums(events, until)), default=0)
    upper = sliding_max(events + unanswered(sent)).tokens
    return Verdict(budget, largest, budget + largest, most.tokens, round(most.start, 2), stepped, upper, within_target(most.tokens, budget, largest))


def phase_rows(o: Options, sent: Sequence[Sent]) -> list[dict[str, Any]]:
    """Per phase: tokens admitted a minute, over the budget; the trailing minute's mean and most; what was offered; what static shares alone would admit.

    The trailing minute at each whole second of the phase, over the budget
    (``window_fullness``), is the utilisation a sliding window allows: 1.0
    when every second's last 60 s hold the whole budget. The admitted rate
    over a short phase swings with what left the window 60 s before.
    """
    names = [replica_name(i) for i in range(o.replicas)]
    trailing = stepped_sums(admitted(sent), o.duration)
    rows = []
    for p in phases(o):
        inside = [total for t, total in trailing if p.start < t <= p.end]
        offered_by = [per_minute(offered(sent, n), p.start, p.end) for n in names]
        admitted_rate = per_minute(admitted(sent), p.start, p.end)
        static = static_share_rate(offered_by, o.static_share, o.budget)
        rows.append(
            asdict(p)
            | {
                "admitted_per_min": round(admitted_rate),
                "utilisation": round(admitted_rate / o.budget, 3),
                "window_fullness": round(sum(inside) / len(inside) / o.budget, 3) if inside else math.nan,
                "most_trailing_minute": max(inside, default=0),
                "offered_per_min": round(sum(offered_by)),
                "static_share_per_min": round(static),
                "static_share_utilisation": round(static / o.budget, 3),
                "admitted_by_replica": {n: round(per_minute(admitted(sent, n), p.start, p.end)) for n in names},
                "offered_by_replica": dict(zip(names, map(round, offered_by))),
            }
        )
    return rows


def bin_rows(o: Options, sent: Sequence[Sent]) -> list[dict[str, Any]]:
    """Per BIN_S of sending: tokens admitted fleet-wide and by replica, budget 429s, and the trailing minute at the bin's end."""
    names = [replica_name(i) for i in range(o.replicas)]
    until = o.duration + o.drain
    total = binned(admitted(sent), BIN_S, until)
    by = {n: binned(admitted(sent, n), BIN_S, until) for n in names}
    refused = binned([(s.sent, 1) for s in sent if s.code == BUDGET_CODE], BIN_S, until)
    trailing = dict(stepped_sums(admitted(sent), until, step=BIN_S))
    rows = []
    for k, tokens in enumerate(total):
        start = k * BIN_S
        if start >= o.duration and not tokens:
            break
        rows.append({"start": start, "admitted": tokens, "by_replica": {n: by[n][k] for n in names}, "budget_429": refused[k],
                     "trailing_minute": trailing.get(start + BIN_S, 0)})
    return rows


def retry_after(sent: Sequence[Sent]) -> dict[str, Any]:
    """The budget refusals: how many, and the Retry-After they carried (s)."""
    values = sorted(s.retry_after for s in sent if s.code == BUDGET_CODE and s.retry_after is not None)
    refused = sum(1 for s in sent if s.code == BUDGET_CODE)
    if not values:
        return {"refused": refused, "with_retry_after": 0}
    return {"refused": refused, "with_retry_after": len(values), "min_s": values[0], "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90), "max_s": values[-1]}


def answer_times(sent: Sequence[Sent]) -> dict[str, float]:
    """The 200s' time to answer, s: every request is the same size, so what the slowest spent beyond the fastest it waited (for a seat, or a grant)."""
    values = sorted(s.ended - s.sent for s in sent if s.status == 200)
    if not values:
        return {}
    return {"min_s": round(values[0], 3), "p50_s": round(percentile(values, 50), 3), "max_s": round(values[-1], 3)}


def mode_changes(health: dict[str, Trail], events: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Per replica: s after Redis stopped until it said fallback, and after Redis resumed until it said ledger again."""
    found: dict[str, dict[str, float | None]] = {}
    stopped, resumed = events.get("redis_stopped_at"), events.get("redis_resumed_at")
    for name, trail in health.items():
        found[name] = {"fallback_after_s": _first(trail, "fallback", stopped), "ledger_again_after_s": _first(trail, "ledger", resumed)}
    return found


def _first(trail: Trail, mode: str, since: float | None) -> float | None:
    if since is None:
        return None
    seen = [at for at, _, m in trail if m == mode and at >= since]
    return round(seen[0] - since, 2) if seen else None


def summarise(o: Options, driven: Driven) -> dict[str, Any]:
    sent = driven.sent
    outcomes: dict[str, int] = {}
    for s in sent:
        outcomes[outcome(s)] = outcomes.get(outcome(s), 0) + 1
    return {
        "verdict": asdict(verdict(sent, o.budget, o.duration + o.drain)),
        "outcomes": dict(sorted(outcomes.items())),
        "requests": len(sent),
        "requests_by_replica": {n: sum(1 for s in sent if s.replica == n) for n in driven.health},
        "phases": phase_rows(o, sent),
        "bins": bin_rows(o, sent),
        "retry_after": retry_after(sent),
        "answer_times": answer_times(sent),
        "mode_changes": mode_changes(driven.health, driven.events),
        "events": {k: round(v, 2) for k, v in driven.events.items()},
    }

