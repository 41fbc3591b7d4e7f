"""The cluster benchmark's report: the result as markdown."""

from __future__ import annotations

from typing import Any

from bench.cluster.lab import OUTAGES


def render(result: dict[str, Any], command: str) -> str:
    """The whole result as markdown: the parameters, the checks, a section for each phase that ran, the notes."""
    lines = _head(result, command) + _cost(result.get("ledger_cost")) + _load(result)
    lines += _kill(result.get("kill"), result["options"])
    for name in OUTAGES:
        out = result.get(name)
        if out:
            lines += _outage(out)
    lines += _affinity(result.get("affinity"), result["options"])
    return "\n".join(lines + _notes(result))


def _head(result: dict[str, Any], command: str) -> list[str]:
    """The run's parameters and the checks' table."""
    o = result["options"]
    lines = [
        "# python -m bench cluster",
        "",
        f"`{command}` on {result['date']}, commit {result['commit']}, {result['cpus']} CPUs, wall time {result['wall_s']:g} s.",
        f"Load average (1, 5, 15 min) at the start {result['load_average_start']}, at the end {result['load_average_end']} "
        "(a shared machine: other work ran beside this one).",
        "",
        f"Engines: one latency engine (interactive pool), two throughput engines (batch pool), endpoint cap {o['seats']} each, "
        f"time scale {o['time_scale']:g} (times below are real); capacity for the origin's mix {result['capacity_per_s']:g} req/s. "
        f"Keys: " + ", ".join(f"{k['name']} {k['share']:.0%} of requests, max_concurrency {k['max_concurrency']}" for k in result["keys"]) + ". "
        f"[cluster]: lease_ttl {o['lease_ttl']:g} s, sync_interval {o['sync_interval']:g} s, block {o['block']}, "
        f"static_share 1/{o['replicas']} for the {o['replicas']} replicas. Warm-up {o['warmup']:g} s, window {o['window']:g} s, "
        f"drain <= {o['drain']:g} s; bursty: twice the rate for half of every {o['burst_period']:g} s, then silence. "
        f"Redis stopped {o['outage']:g} s, paused {o['pause']:g} s.",
        "",
        "## Checks",
        "",
        "| check | verdict | detail |",
        "|---|---|---|",
        *(f"| {c['check']} | {c['verdict']} | {c['detail']} |" for c in result["checks"]),
        "",
    ]
    return lines


def _cost(cost: dict[str, Any] | None) -> list[str]:
    """Phase 1: what the ledger adds per request; nothing when it did not run."""
    if not cost:
        return []
    lines = [
        "## What the ledger adds per request",
        "",
        f"Open loop, Poisson {cost['rate']:g} req/s, short non-streaming chat (16 tokens) on an instant engine, "
        f"{cost['rounds']} alternating rounds of {cost['seconds_per_round']:g} s each.",
        "",
        "| tailguard | n | errors | p50 ms | p90 ms | p99 ms | CPU µs/request |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("plain", "ledger"):
        c = cost[name]
        lines.append(f"| {name} | {c['n']} | {c['errors']} | {c['p50_ms']:.3f} | {c['p90_ms']:.3f} | {c['p99_ms']:.3f} | {c['cpu_us_per_request']:.0f} |")
    added = cost["added_ms"]
    lines += ["", f"Added by the ledger: p50 {added['p50']:+.3f} ms, p90 {added['p90']:+.3f} ms, p99 {added['p99']:+.3f} ms.", ""]
    return lines


def _load(result: dict[str, Any]) -> list[str]:
    """Phase 2: one row per load run; nothing when it did not run."""
    if not result.get("load"):
        return []
    o = result["options"]
    lines = [
        "## Load",
        "",
        "| set-up | traffic | load | req/s | short ok / n | short 429 / 503 | short E2E p50 / p99 ms | long ok / n | long E2E p50 ms | "
        "engines max in engine / cap | keys most streaming at once / cap | 429 per key | machine cores | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["load"]:
        s, lg = r["short"], r["long"]
        engines = " ".join(f"{w['max_in_engine']}/{w['cap']}" for w in r["engines"].values())
        keys = " ".join(f"{v['max_streaming']}/{v['cap'] if o.get('key_caps', True) else '-'}" for v in r["keys"].values())
        rejected = " ".join(f"{k}:{v['outcomes'].get('429', 0)}" for k, v in r["keys"].items())
        lines.append(
            f"| {r['setup']} | {r['traffic']} | {r['load']:g} | {r['rate_per_s']:.1f} | {s['outcomes'].get('ok', 0)}/{s['n']} | "
            f"{s['outcomes'].get('429', 0)} / {s['outcomes'].get('503', 0)} | {s['e2e_ms']['p50']:.0f} / {s['e2e_ms']['p99']:.0f} | "
            f"{lg['outcomes'].get('ok', 0)}/{lg['n']} | {lg['e2e_ms']['p50']:.0f} | {engines} | {keys} | {rejected} | {r['machine_cores']:.2f} | {r['load_average'][0]:g} |"
        )
    lines += ["", "Engines: interactive, batch-1, batch-2. Keys: " + ", ".join(k["name"] for k in result["keys"]) + ".", ""]
    return lines


def _kill(kill: dict[str, Any] | None, o: dict[str, Any]) -> list[str]:
    """Phase 3: kill -9 one replica; nothing when it did not run."""
    if not kill:
        return []
    return [
        "## kill -9 one replica",
        "",
        f"{kill['victim']} killed {kill['kill_at_s']:g} s into a Poisson run at load {o['loads'][0]:g} ({kill['arrivals']} arrivals), "
        "then dropped from the client's round robin.",
        "",
        f"- its grants at the kill: {kill.get('victim_grants_at_kill')}",
        f"- its lease gone from Redis {kill['lease_gone_after_s']} s after the kill; its grants gone from every hash {kill['grants_gone_after_s']} s after",
        f"- ledger afterwards: {kill.get('grants_after')}",
        f"- survivors' requests: {kill['survivor_outcomes']} (unanswered {kill['survivor_unanswered']}); the victim's: {kill['victim_outcomes']}",
        f"- survivors' short E2E p50 / p99: {kill['survivor_short']['e2e_ms']['p50']:.0f} / {kill['survivor_short']['e2e_ms']['p99']:.0f} ms",
        "- engines, max in engine / cap: " + ", ".join(f"{role} {w['max_in_engine']}/{w['cap']}" for role, w in kill["engines"].items()),
        "",
    ]


def _outage(out: dict[str, Any]) -> list[str]:
    """Phase 4 or 5: one Redis outage."""
    what = "killed (SIGKILL), started again empty on the same port" if out["mode"] == "stop" else "paused (SIGSTOP), then resumed (SIGCONT)"
    return [
        f"## Redis {out['mode']}: {out['hold_s']:g} s" + (", a replica holding most seats (block 0)" if out["skew"] else ""),
        "",
        f"Poisson at load {out['load']:g}, {out['arrivals']} arrivals, replicas {', '.join(out['replicas'])}; redis-server {what}: "
        f"down at {out['redis_down_at_s']} s, back at {out['redis_back_at_s']} s."
        + (f" {out['victim']} killed (SIGKILL) at {out.get('victim_killed_at_s')} s." if out["victim"] else "")
        + (f" Replicas with block 0 and keys without max_concurrency, in a namespace of their own; until Redis went, the client "
           f"sent every request to {out['replicas'][0]} (a balancer out of step), round robin from then on." if out["skew"] else ""),
        "",
        f"- each replica's requests on each capped engine when Redis went (its tailguard_endpoint_in_flight): {out.get('held_at_outage')}",
        f"- outcomes: {out['outcomes']}; unanswered on survivors {out['unanswered_on_survivors']}",
        f"- ok answers to requests sent during the outage (from 1 s after it began), per replica: {out['ok_during_outage']}",
        f"- every replica in fallback within {out['fallback_within_s']} s; on the ledger again within {out['ledger_again_within_s']} s of Redis's return",
        f"- grants each replica used 1 s before Redis came back (its /metrics): {out['grants_in_fallback']}",
        "- engines, max in engine / cap: " + ", ".join(f"{role} {w['max_in_engine']}/{w['cap']}" for role, w in out["engines"].items()),
        "- keys, most streaming at once / cap: " + ", ".join(f"{k} {v['max_streaming']}/{v['cap']}" for k, v in out["keys"].items()),
        f"- ledger reads during the run: {out['ledger_reads']}; largest sum of grants per resource: {out['ledger_max_sum']}",
        f"- ledger afterwards (idle): {out['grants_after']}",
        f"- dead replicas' keys left: {out['dead_in_ledger'] or 'none'}; tailguard_pool_in_flight afterwards: {out['in_flight_after']}",
        "- /health per replica (time s, status, cluster mode): "
        + "; ".join(f"{n}: " + ", ".join(f"{t:g} {st} {m}" for t, st, m in trail) for n, trail in out["health"].items()),
        "",
    ]


def _affinity(affinity: dict[str, Any] | None, o: dict[str, Any]) -> list[str]:
    """The affinity phase: a row per placement; nothing when it did not run."""
    if not affinity:
        return []
    lines = [
        "## Affinity: one prefix, one engine, from every replica",
        "",
        f"{o['replicas']} replicas sharing one `[cluster]` namespace, a pool of {affinity['engines']} instant engines; "
        f"{affinity['requests']} requests, each one of {affinity['tenants']} tenants' ~300-token system prompts and a question "
        "unique to it, one at a time per replica, round robin over the replicas; where each ran from the replicas' access logs.",
        "",
        "| placement | joined | on the tenant's engine | share | (replica, tenant) pairs agreeing | requests per engine | Redis commands / request | client P50 / P99 ms | wall s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in affinity["runs"]:
        lines.append(
            f"| {run['placement']} | {run['joined']} | {run['on_tenant_engine']} | {run['share']} | {run['replica_tenant_pairs_agreeing']} | "
            f"{' '.join(map(str, run['requests_per_engine'].values()))} | {run['redis_commands_per_request']} | "
            f"{run['latency_ms']['p50']} / {run['latency_ms']['p99']} | {run['wall_s']} | {run['errors']} |"
        )
    return [*lines, ""]


def _notes(result: dict[str, Any]) -> list[str]:
    """What the checks cannot see, said once per report."""
    return [
        "## Notes",
        "",
        f"- Fallback warnings each replica logged (one per outage expected): {result.get('fallback_warnings')}",
        "- The engines' own maximum (`EngineStatistics.max_running_seen` in bench/sim/engine.py) is not on the simulator's "
        "HTTP surface; the check above rests on the /metrics gauges sampled every ~10 ms (see the mean interval). "
        "A gauge such as `vllm:num_requests_running_max` (or `sim:max_running_seen`) in bench/sim/metrics.py would make it exact.",
        "- Per-key concurrency is counted at the client from the first to the last token of each 200 answer, which lies "
        "inside the router's hold of the key's seat but for the client's own read lag at the end; "
        "`max_sent_to_end` in the JSON (send to last byte) is an upper bound.",
        "",
    ]
