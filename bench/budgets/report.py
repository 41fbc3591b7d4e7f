"""The budget benchmark's markdown: the target's verdict, utilisation per phase, tokens per 10 s by replica, modes, 429s."""

from __future__ import annotations

from typing import Any

from bench.budgets.model import Result
from bench.harness.report import Target, md_table, targets_table


def render(result: Result) -> str:
    """The report of a run (its ``summary`` from ``numbers.summarise``)."""
    s, p = result.summary, result.parameters
    v = s["verdict"]
    names = list(s["requests_by_replica"])
    lines = [
        "# A token budget shared by replicas on one Redis (issue 24)",
        "",
        f"Command: `{' '.join(result.command)}`  ",
        f"Code: {result.code}  ",
        f"Wall: {result.wall_s:.0f} s; load average (1, 5, 15 min) {_loads(result.load_average)}",
        "",
        f"{p['replicas']} replicas, `static_share = {p['static_share']:g}`, lease_ttl {p['lease_ttl']:g} s, sync_interval {p['sync_interval']:g} s; "
        f"one key with `tokens_per_minute = {p['budget']}`; {p['arrivals']} requests of {p['reserve']} tokens "
        f"(prompt {p['prompt_tokens']}, max_tokens {p['max_tokens']}, ignore_eos), Poisson at {p['rate_per_s']:.2f} req/s "
        f"({p['load']:g}x the budget's rate), spread {' / '.join(f'{x:.0%}' for x in p['spread'])} over {', '.join(names)}. "
        f"Events: {', '.join(f'{k} {t:g} s' for k, t in s['events'].items()) or 'none'}.",
        "",
        *targets_table([Target(
            "tokens in any 60 s, fleet-wide",
            f"<= budget + one largest request = {v['budget']} + {v['largest']} = {v['bound']}",
            f"{v['most']} (window from {v['most_at']:g} s; on whole seconds {v['most_stepped']}; "
            f"counting every unanswered request at its reservation {v['most_with_unanswered']})",
            v["met"],
        )]),
        "",
        "## Utilisation per phase (tokens admitted a minute / budget)",
        "",
        *md_table(
            ["phase", "s", "offered/min", "admitted/min", "utilisation", "trailing 60 s: mean / budget", "most", "static shares alone",
             *(f"{n} admitted/min" for n in names)],
            (
                [r["name"], f"{r['start']:g}-{r['end']:g}", r["offered_per_min"], r["admitted_per_min"], f"{r['utilisation']:.2f}",
                 f"{r['window_fullness']:.2f}", r["most_trailing_minute"],
                 f"{r['static_share_per_min']} ({r['static_share_utilisation']:.2f})", *(r["admitted_by_replica"][n] for n in names)]
                for r in s["phases"]
            ),
        ),
        "",
        "Utilisation: tokens admitted over the phase, a minute, over the budget (it swings with what left the window 60 s before); "
        "the trailing 60 s at each whole second of the phase, its mean over the budget and its most. "
        "\"Static shares alone\": what each replica admits within its static_share of the budget, given what it was offered "
        "(a steady-state figure: the sliding window carries the minute before a phase into it).",
        "",
        "## Tokens admitted per 10 s (by send time)",
        "",
        *md_table(
            ["from s", "fleet", *names, "budget 429s", "trailing 60 s", ""],
            (
                [f"{b['start']:g}", b["admitted"], *(b["by_replica"][n] for n in names), b["budget_429"], b["trailing_minute"],
                 "#" * round(40 * b["trailing_minute"] / max(v["bound"], 1))]
                for b in s["bins"]
            ),
        ),
        "",
        "The bar is the trailing 60 s at the bin's end, 40 marks = budget + one largest request.",
        "",
        "## Outcomes and Retry-After",
        "",
        *md_table(["outcome", "requests"], s["outcomes"].items()),
        "",
        f"Budget 429s (token_budget_exceeded): {_seconds(s['retry_after'])}. "
        f"The 200s' time to answer (all of one size; beyond the fastest, a wait): {_seconds(s['answer_times'])}.",
        "",
        "## Cluster mode (/health every 0.25 s)",
        "",
        *md_table(
            ["replica", "requests", "fallback after Redis stopped, s", "ledger again after it resumed, s", "trail (s, status, mode)"],
            (
                [n, s["requests_by_replica"][n], _cell(s["mode_changes"][n]["fallback_after_s"]), _cell(s["mode_changes"][n]["ledger_again_after_s"]),
                 "; ".join(f"{at:g} {st} {m}" for at, st, m in result.health[n])]
                for n in names
            ),
        ),
    ]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _loads(averages: dict[str, list[float]]) -> str:
    return "; ".join(f"{when} " + " ".join(f"{x:.2f}" for x in values) for when, values in averages.items())


def _seconds(figures: dict[str, Any]) -> str:
    """``{"p50_s": 1.5, "refused": 3}`` as ``p50 1.5 s, refused 3``."""
    return ", ".join(f"{k.removesuffix('_s')} {v:g} s" if k.endswith("_s") else f"{k.replace('_', ' ')} {v}" for k, v in figures.items()) or "none"
