"""The cluster benchmark's checks: what must hold, judged on the result."""

from __future__ import annotations

import math
from typing import Any

from bench.cluster.lab import LEDGER_POLL_S, OUTAGES


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/MISS per target of the issue this run can judge."""
    found: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        found.append({"check": name, "verdict": "info" if ok is None else ("PASS" if ok else "MISS"), "detail": detail})

    o = result["options"]
    runs = result.get("load", [])
    phases = [("load " + f"{r['setup']} {r['traffic']} {r['load']:g}", r) for r in runs]
    phases += [(name, result[name]) for name in ("kill", *OUTAGES) if name in result]
    over = [
        f"{label}: {role} {w['max_in_engine']}/{w['cap']} (first at {w['first_over_s']} s, {w['over_cap_looks']} looks)"
        for label, r in phases for role, w in r["engines"].items() if w["max_in_engine"] > w["cap"]
    ]
    watched = [w for _, r in phases for w in r["engines"].values()]
    if watched:  # the cost phase alone watches no engine: nothing to judge
        intervals = [w["mean_interval_ms"] for w in watched]
        add("no engine ever above its cap (running + waiting, engines' /metrics)", not over,
            f"{sum(w['looks'] for w in watched)} looks, mean interval {min(intervals):.1f}-{max(intervals):.1f} ms, "
            f"longest gap {max(w['longest_gap_ms'] for w in watched):.0f} ms; " + ("; ".join(over) if over else "max seen = cap at most"))
    key_over = [
        f"{label}: {k} {v['max_streaming']}/{v['cap']} for {v['longest_above_cap_ms']} ms"
        for label, r in phases for k, v in r["keys"].items() if v["max_streaming"] > v["cap"]
    ]
    if o.get("key_caps", True) and phases:
        add("no API key above its max_concurrency (client: first to last token of each 200)", not key_over, "; ".join(key_over) or "none")
    cost = result.get("ledger_cost")
    if cost:
        add("added latency per request from the ledger (instant engine, 1 replica, [cluster] vs none)", None,
            f"p50 {cost['added_ms']['p50']:+.3f} ms, p99 {cost['added_ms']['p99']:+.3f} ms at {cost['rate']:g} req/s")
    by = {(r["setup"], r["traffic"], r["load"]): r for r in runs}
    many = f"{o['replicas']} replicas"
    for (setup, traffic, load), run in by.items():
        if setup != many or ("1 replica", traffic, load) not in by:
            continue
        one = by[("1 replica", traffic, load)]["short"]["e2e_ms"]["p99"]
        mine = run["short"]["e2e_ms"]["p99"]
        ratio = mine / one if one and not math.isnan(one) else math.nan
        add(f"short E2E P99 {many} <= 1.1x 1 replica ({traffic} {load:g})", ratio <= 1.1, f"{mine:.0f} ms vs {one:.0f} ms: {ratio:.2f}x")
    if ("1 replica + ledger", o["traffics"][0], o["loads"][0]) in by:
        with_ledger = by[("1 replica + ledger", o["traffics"][0], o["loads"][0])]["short"]["e2e_ms"]
        plain = by[("1 replica", o["traffics"][0], o["loads"][0])]["short"]["e2e_ms"]
        add(f"short E2E, 1 replica with [cluster] vs without ({o['traffics'][0]} {o['loads'][0]:g})", None,
            f"p50 {with_ledger['p50'] - plain['p50']:+.0f} ms, p99 {with_ledger['p99'] - plain['p99']:+.0f} ms (real)")
    kill = result.get("kill")
    if kill:
        gone, cleared = kill["lease_gone_after_s"], kill["grants_gone_after_s"]
        add("kill -9: the dead replica's seats return within lease_ttl", gone is not None and gone <= o["lease_ttl"] + LEDGER_POLL_S,
            f"lease gone {gone} s, grants out of the ledger {cleared} s after the kill (lease_ttl {o['lease_ttl']:g} s, sync {o['sync_interval']:g} s); "
            f"it held {kill.get('victim_grants_at_kill')}")
        add("kill -9: every request on the survivors ends with one answer", kill["survivor_unanswered"] == 0,
            f"survivors {kill['survivor_outcomes']}; on the victim {kill['victim_outcomes']}")
    found += _affinity_checks(result.get("affinity"))
    for name in OUTAGES:
        out = result.get(name)
        if not out:
            continue
        label = f"Redis {out['mode']} {out['hold_s']:g} s" + (", skewed, block 0" if out["skew"] else "")
        over_engine = [
            f"{role} {w['max_in_engine']}/{w['cap']} from {w['first_over_s']} s ({w['over_cap_looks']} looks; Redis down {out['redis_down_at_s']} s, "
            f"back {out['redis_back_at_s']} s)"
            for role, w in out["engines"].items() if w["max_in_engine"] > w["cap"]
        ]
        add(f"{label}: caps never exceeded (engines)", not over_engine, "; ".join(over_engine) or "max in engine <= cap on every engine")
        served = out["ok_during_outage"]
        victim = out["victim"]
        continues = out["degraded_everywhere"] and all(n > 0 for name_, n in served.items() if name_ != victim) and out["fallback_within_s"] is not None
        add(f"{label}: service continues, degraded, on static shares", continues,
            f"fallback on every replica within {out['fallback_within_s']} s; ok answers sent during the outage per replica {served}; "
            f"back on the ledger within {out['ledger_again_within_s']} s of Redis's return; unanswered on survivors {out['unanswered_on_survivors']}")
        consistent = not out["ledger_over_cap"] and not out["strangers_after"] and not out["dead_in_ledger"] and not out["idle_grant_above_block"] \
            and not any(out["in_flight_after"].values())
        add(f"{label}: ledger consistent afterwards", consistent,
            f"max sum of grants {out['ledger_max_sum']} (over cap: {out['ledger_over_cap'] or 'none'}); idle grants {out['grant_sum_after']}; "
            f"above block: {out['idle_grant_above_block'] or 'none'}; unknown replicas {out['strangers_after'] or 'none'}; "
            f"dead replicas' keys {out['dead_in_ledger'] or 'none'}; in flight after {out['in_flight_after']}")
    return found


def _affinity_checks(affinity: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The same prefix on the same engine from every replica, and no more Redis commands per request than without affinity."""
    if not affinity:
        return []
    default = [run for run in affinity["runs"] if run["placement"] == "default"]
    plain = [run for run in affinity["runs"] if run["placement"] == "least_loaded"]
    shares = [run["share"] for run in default]
    found = [{
        "check": f"affinity: one tenant's prefix on one engine from every replica >= {affinity['target_share']:.0%}",
        "verdict": "PASS" if None not in shares and min(shares) >= affinity["target_share"] else "MISS",
        "detail": "; ".join(
            f"{run['on_tenant_engine']}/{run['joined']} ({run['share']}), (replica, tenant) pairs agreeing {run['replica_tenant_pairs_agreeing']}, "
            f"per engine {list(run['requests_per_engine'].values())}, errors {run['errors']}" for run in default
        ) + f" ({affinity['tenants']} tenants, {affinity['engines']} engines)",
    }]
    if plain:
        mine, theirs = (sum(run["redis_commands_per_request"] for run in runs) / len(runs) for runs in (default, plain))
        found.append({
            "check": "affinity: no extra round trip (Redis commands per request, mean of the runs, vs least_loaded; info: they grow with the run's wall time)",
            "verdict": "info",
            "detail": f"{mine:.1f} vs {theirs:.1f}; client P50 ms " + ", ".join(f"{r['placement']} {r['latency_ms']['p50']}" for r in affinity["runs"])
            + f"; least_loaded share {', '.join(str(r['share']) for r in plain)}",
        })
    return found
