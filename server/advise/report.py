"""advise's report: the table of every candidate, the verdict, the config snippet, and the JSON of it all."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from tailguard.router.config import LendConfig

from .candidates import Candidate, engine_url
from .fleet import Fleet, PoolPlan
from .thresholds import Bounds, threshold_keys
from .verdict import E2E_BOUND, TTFT_BOUND, Advice, Prediction


def _s(value: float) -> str:
    return "fail" if math.isinf(value) else "-" if math.isnan(value) else f"{value:.3f}"


def _x(value: float) -> str:
    return "inf" if math.isinf(value) else "-" if math.isnan(value) else f"{value:.2f}"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def table(advice: Advice) -> str:
    """Markdown: the baselines, then every candidate, the recommended one marked."""
    rows = [
        "| set-up | lending | borrowed prefill stall per step, ms | short E2E P99 s | x ideal | short TTFT P99 s | x ideal "
        "| short failed | long finished/s | x round robin | prefix hit rate | within bounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("short-only ideal", advice.ideal), ("shared round robin", advice.shared)):
        rows.append(
            f"| {name} | - | - | {_s(s.short_e2e_p99)} | - | {_s(s.short_ttft_p99)} | - | {s.short_failed} "
            f"| {s.long_goodput:.2f} | - | {_rate(s.prefix_hit_rate)} | - |"
        )
    for p in advice.predictions:
        s, c = p.stats, p.candidate
        mark = " **<- recommended**" if p is advice.recommended else ""
        split = "shared" if c.shared else f"{c.interactive}:{c.batch}"
        rows.append(
            f"| {split}{mark} | {c.rule} | {p.stall_ms:.0f} | {_s(s.short_e2e_p99)} | {_x(p.e2e_ratio)} | {_s(s.short_ttft_p99)} "
            f"| {_x(p.ttft_ratio)} | {s.short_failed} | {s.long_goodput:.2f} | {_x(p.goodput_ratio)} | {_rate(s.prefix_hit_rate)} "
            f"| {'yes' if p.meets else 'no'} |"
        )
    return "\n".join(rows)


def _lend_lines(lend: LendConfig) -> list[str]:
    lines = [f"to = {json.dumps(list(lend.to))}"]
    if lend.to:
        if lend.max_seats is not None:
            lines.append(f"max_seats = {lend.max_seats}")
        lines.append(f"reserve = {lend.reserve}")
        if lend.max_prompt_tokens is not None:
            lines.append(f"max_prompt_tokens = {lend.max_prompt_tokens}")
        if lend.max_imbalance is not None:
            lines.append(f"max_imbalance = {lend.max_imbalance:g}")
        if lend.max_output_tokens is not None:
            lines.append(f"max_output_tokens = {lend.max_output_tokens}")
        if lend.prefills is not None:
            lines.append(f"prefills = {lend.prefills}")
        if lend.ttft_budget is not None:
            lines.append(f"ttft_budget = {lend.ttft_budget:g}")
        lines.append(f'when = "{lend.when}"')
    return lines


def _profile_note(name: str, plan: PoolPlan) -> str:
    p = plan.params
    return f"# {name}: vLLM --max-num-seqs {p.max_num_seqs} --max-num-batched-tokens {p.max_num_batched_tokens} (the {plan.profile!r} profile)"


MERGE = "# Merge into your config.toml: set the keys below in the tables of the same names; keys not shown stay as they are."


def snippet(fleet: Fleet, candidate: Candidate, thresholds: Bounds | None = None) -> str:
    """The config.toml lines that make ``candidate``: both pools' endpoints and caps, the lend tables, the classes'
    pools where they change, and with ``thresholds`` the first class's bounds.

    Each table appears once (TOML refuses a table declared twice, and so the
    pasted file): a class the shared pool routes and whose bounds change has
    one table with both. The file's endpoint URLs are used in order (its
    interactive pool's first); engines beyond them get placeholder URLs to
    fill in.
    """
    urls = list(fleet.urls[: fleet.engines]) + [engine_url(i) for i in range(len(fleet.urls), fleet.engines)]
    out = _shared_pool(fleet, urls) if candidate.shared else _split_pools(fleet, candidate, urls)
    classes: dict[str, list[str]] = {k.name: [f'pool = "{fleet.batch.config.name}"'] for k in fleet.base.classes} if candidate.shared else {}
    if thresholds is not None and thresholds.none:
        classes.pop(fleet.short_class, None)
        out.append(
            f"# No interactive class: remove [classes.{fleet.short_class}] and its sub-tables (every request is then the catch-all class's)."
        )
    elif thresholds is not None:
        classes.setdefault(fleet.short_class, []).extend(threshold_keys(thresholds))
        classes = {k.name: classes[k.name] for k in fleet.base.classes if k.name in classes}  # in the file's order: the first class matches first
    for name, keys in classes.items():
        out += [f"[classes.{name}]", *keys, ""]
    return "\n".join(out).rstrip() + "\n"


def _pools(plan: PoolPlan, urls: Sequence[str], lend: LendConfig) -> list[str]:
    """One pool's table with its endpoints and caps, and its lend table (an empty one too: the file may lend where this does not)."""
    return [
        f"[pools.{plan.config.name}]",
        f"max_concurrency = {plan.seats * len(urls)}",
        f"max_queue = {plan.queue * len(urls)}",
        "endpoints = [",
        *(f'    {{ url = "{url}", max_concurrency = {plan.seats} }},' for url in urls),
        "]",
        "",
        f"[pools.{plan.config.name}.lend]",
        *_lend_lines(lend),
        "",
    ]


def _split_pools(fleet: Fleet, candidate: Candidate, urls: Sequence[str]) -> list[str]:
    return [
        f"# tailguard advise: {candidate.interactive} engine(s) interactive, {candidate.batch} batch; {candidate.rule}.",
        MERGE,
        _profile_note("interactive engines", fleet.interactive),
        _profile_note("batch engines", fleet.batch),
        *_pools(fleet.interactive, urls[: candidate.interactive], candidate.lend),
        *_pools(fleet.batch, urls[candidate.interactive :], candidate.lend_back),
    ]


def _shared_pool(fleet: Fleet, urls: Sequence[str]) -> list[str]:
    """The shared pool: every engine in the batch pool (the caller routes every class to it)."""
    return [
        f"# tailguard advise: all {fleet.engines} engines in one pool, every class in it, the interactive class queued first.",
        MERGE,
        "# Then remove the other pool's table (and its sub-tables).",
        _profile_note("every engine", fleet.batch),
        *_pools(fleet.batch, urls, LendConfig()),
    ]


def report(advice: Advice) -> str:
    fleet, best = advice.fleet, advice.recommended
    s = best.stats
    head = (
        f"{advice.source}: {advice.arrivals} requests over {advice.seconds:.1f} s (GPU time)"
        + (f", {advice.dropped} dropped (over the router's caps)" if advice.dropped else "")
        + f"; {fleet.engines} engines: interactive pool {fleet.interactive.profile!r} (cap {fleet.interactive.seats} each), "
        f"batch pool {fleet.batch.profile!r} (cap {fleet.batch.seats} each); {len(advice.predictions)} candidates "
        f"simulated in {advice.wall_s:.1f} s (wall) on this CPU. Bounds: short E2E P99 <= {E2E_BOUND:g}x and short TTFT P99 <= "
        f"{TTFT_BOUND:g}x the short-only ideal's. Long finished/s: long requests finished ok per second from the "
        "trace's start to the last one's end."
    )
    verdict = (
        f"Recommended: {best.candidate.name} -- short E2E P99 {_s(s.short_e2e_p99)} s ({_x(best.e2e_ratio)}x ideal), "
        f"short TTFT P99 {_s(s.short_ttft_p99)} s ({_x(best.ttft_ratio)}x), long {s.long_goodput:.2f}/s "
        f"({_x(best.goodput_ratio)}x round robin)."
    )
    if not advice.met:
        verdict = (
            f"No candidate meets both bounds. Best trade-off (the least over them, then the most long goodput): {verdict[len('Recommended: ') :]}"
        )
    mix = f"Short by the file's thresholds: {advice.short_share:.0%} of the requests" + (
        "" if math.isnan(advice.short_token_share) else f", {advice.short_token_share:.0%} of their prompt and output tokens"
    ) + "."
    if advice.short_share < 0.5:  # the real traces' case (docs/pools.md): a split's latency engines idle while batch queues
        mix += (
            " Most requests are long here: a split gives the few short ones whole engines that long ones then lack;"
            " compare the shared pool's row."
        )
    head = f"{head}\n\n{mix}"
    unmodelled = "Prefix cache: not modelled (--no-prefix-cache): every prompt is unique."
    cache = (unmodelled if advice.sharing is None else advice.sharing.summary()) + " Prefix hit rate: cached prompt tokens over those looked up, all engines."
    return "\n\n".join([head, cache, table(advice), verdict, "```toml\n" + snippet(fleet, best.candidate) + "```"]) + "\n"


def advice_json(advice: Advice) -> dict[str, Any]:
    def pred(p: Prediction) -> dict[str, Any]:
        return {"candidate": p.candidate.name, "lend": dataclasses.asdict(p.candidate.lend),
                "lend_back": dataclasses.asdict(p.candidate.lend_back), "stats": dataclasses.asdict(p.stats),
                "e2e_vs_ideal": p.e2e_ratio, "ttft_vs_ideal": p.ttft_ratio, "goodput_vs_shared": p.goodput_ratio,
                "stall_ms": p.stall_ms, "meets": p.meets, "prefix_hit_rate": p.stats.prefix_hit_rate}

    def safe(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: safe(v) for k, v in value.items()}
        if isinstance(value, list):
            return [safe(v) for v in value]
        return value

    found: dict[str, Any] = safe({
        "source": advice.source,
        "engines": advice.fleet.engines,
        "arrivals": advice.arrivals,
        "dropped": advice.dropped,
        "seconds": advice.seconds,
        "wall_s": advice.wall_s,
        "ideal": dataclasses.asdict(advice.ideal),
        "shared": dataclasses.asdict(advice.shared),
        "candidates": [pred(p) for p in advice.predictions],
        "recommended": advice.recommended.candidate.name,
        "meets_bounds": advice.met,
        "prefix_sharing": None if advice.sharing is None else dataclasses.asdict(advice.sharing),
    })
    return found
