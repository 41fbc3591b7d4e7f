"""``python -m bench.trace.replay``: a real trace replayed in virtual time, tailguard beside round robin and a hand split.

The trace is ``../shared/traces/mooncake_conversation_trace.jsonl`` (Kimi's
production chat service, released with the Mooncake paper, FAST '25,
kvcache-ai/Mooncake, Apache-2.0): each request's arrival, prompt and output
lengths, and its prompt as ``hash_ids``, one per 512-token block (equal ids:
equal text, and every block before equal too). Requests are classed as the
shipped config classes them (short: prompt <= 500 and max_tokens <= 128),
and every set-up gets the same arrivals. Each prompt is built block by block
from its ``hash_ids`` (``prompt_text``), so the engines' prefix cache (on, as
in vLLM) sees the trace's real reuse; ``--unique-prompts`` gives every
request unique filler instead (nothing reused).

Set-ups, on the same engines: round robin over throughput engines (no
router); the hand split (each class straight to its own engines); tailguard
with that split, each pool lending as the shipped ``config.toml``'s
``[pools.NAME.lend]`` says (``--lend-config`` reads another file's), with
the input cap raised to the engines' context so that it refuses what the
engines would, no more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from bench.harness.report import write_json
from bench.trace.load import CONTEXT
from bench.trace.mooncake import prompt_text
from bench.trace.samples import FULL_MOONCAKE as TRACE
from bench.trace.setups import SHIPPED_CONFIG, lend_rules, tailguard_split
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.replay.point import Point, run_point
from tailguard.server.advise.replay.setups import shared, split_direct


def arrivals(path: Path, count: int, speed: float, *, reuse: bool = True) -> tuple[Arrival, ...]:
    """The first ``count`` requests, time compressed by ``speed``, classed as the shipped config would.

    With ``reuse`` each carries its prompt text from ``hash_ids``; else the
    fleet sends unique filler of its length.
    """
    rows = []
    with path.open() as lines:
        for line in lines:
            rows.append(json.loads(line))
            if len(rows) == count:
                break
    origin = rows[0]["timestamp"]
    out: list[Arrival] = []
    for row in rows:
        prompt, tokens = int(row["input_length"]), max(1, int(row["output_length"]))
        if prompt + tokens > CONTEXT:  # no set-up's engines could serve it: left out of every one
            continue
        kind = "short" if prompt <= 500 and tokens <= 128 else "long"
        text = prompt_text(row.get("hash_ids", ()), prompt) if reuse else None
        out.append(Arrival(len(out), (row["timestamp"] - origin) / 1000 / speed, kind, True, prompt, tokens, text))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace.replay", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=1200, help="the trace's first N requests (default %(default)s)")
    parser.add_argument("--speed", type=float, default=2.0, help="time compression (default %(default)s)")
    parser.add_argument("--engines", default="1:3", help="interactive:batch engines of the split (default %(default)s)")
    parser.add_argument("--unique-prompts", action="store_true", help="ignore hash_ids: every prompt unique (no reuse to hit)")
    parser.add_argument("--lend-config", type=Path, default=SHIPPED_CONFIG, help="the file whose lend rules tailguard uses (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "sweep" / "trace.json")
    args = parser.parse_args(argv)
    fast, slow = (int(n) for n in args.engines.split(":"))
    schedule = arrivals(args.trace, args.requests, args.speed, reuse=not args.unique_prompts)
    window = schedule[-1].at + 1
    setups = [shared(fast + slow, name="round robin"), split_direct(fast, slow), tailguard_split(fast, slow, lend_rules(args.lend_config))]
    results = [run_point(Point(setup, 1.0, len(schedule) / window, 0.0, window, 0, schedule)) for setup in setups]
    rows = []
    for result in results:
        for stats in result.classes:
            if stats.n:
                rows.append(
                    {"setup": result.setup, **dataclasses.asdict(stats), "wall_s": round(result.wall_s, 1), "prefix_hit_rate": result.prefix_hit_rate}
                )
    print(f"{args.trace.name}: first {args.requests} requests, {len(schedule)} within the {CONTEXT}-token context, {args.speed:g}x, {sum(a.kind == 'short' for a in schedule)} short")
    print("| set-up | class | n | ok | outcomes | TTFT P50 / P99 ms | E2E P50 / P99 ms | completed/s | prefix hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setup']} | {row['kind']} | {row['n']} | {row['ok']} | {row['outcomes']} |"
            f" {row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['e2e_p50_ms']:.0f} / {row['e2e_p99_ms']:.0f} |"
            f" {row['ok'] / window:.2f} | {row['prefix_hit_rate']:.3f} |"
        )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
