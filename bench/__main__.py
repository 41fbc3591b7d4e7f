"""``python -m bench <driver> [--help | options]``: every benchmark, one command each.

Each driver prints its parameters and numbers, writes JSON (and plots or
markdown) under ``bench/results/``, and takes ``--help``. ``python -m bench``
alone lists them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module with main(argv), what it measures); the order is the listing's
DRIVERS: dict[str, tuple[str, str]] = {
    "tail": ("bench.tail.run", "short-request P99 under mixed load, set-ups side by side"),
    "quick-mixed": ("bench.tail.quick_mixed", "the first tail run: one shared engine vs tailguard, the origin's mix"),
    "overhead": ("bench.overhead.run", "what the router adds per request and per relayed event, beside vllm-router"),
    "router-overhead": ("bench.overhead.closed_loop", "closed-loop HTTP latency and CPU per request, direct vs through tailguard"),
    "grpc-overhead": ("bench.overhead.grpc_streams", "the gRPC front end: unary calls, streams, 10,000 open streams"),
    "sse-check": ("bench.overhead.sse_check", "in process: what the HTTP relay's check of every SSE event costs per event"),
    "sse-decoder": ("bench.overhead.sse_decoder", "the gRPC side's SSE decoder on a 64 MB line cut small, over merely keeping its bytes: linear or not"),
    "hold": ("bench.overhead.hold", "RSS while holding 10,000 HTTP SSE streams; GC pauses under relay, per GC threshold"),
    "prefix": ("bench.prefix.run", "shared prefixes: tenants, conversations, RAG, Mooncake; placement side by side with vllm-router"),
    "sweep": ("bench.sweep.run", "the policy in virtual time: loads x set-ups x splits"),
    "trace": ("bench.trace.run", "real traces (Mooncake, ShareGPT lengths) in virtual time: per class vs round robin and a hand split"),
    "chaos": ("bench.chaos.run", "killed, hung and broken engines, hostile clients, reloads: what must hold"),
    "cluster": ("bench.cluster.run", "replicas sharing caps on Redis: caps under load, kill -9, Redis down"),
    "workers": ("bench.overhead.workers", "serve --workers 2 beside --workers 1 and vllm-router: req/s, CPU per request"),
    "sim-cpu": ("bench.simcheck.cpu", "the simulator's own CPU while streaming to many clients"),
    "tenants": ("bench.tenants.run", "two API keys on one small pool: fair shares vs FIFO under a burst, weighted shares backlogged"),
    "retry": ("bench.retry.run", "the openai SDK's retries under 1.5x overload: computed Retry-After vs a fixed 1 s"),
    "cardinality": ("bench.tenants.cardinality", "API keys rotated by reloads: /metrics size and lines, RSS after an idle minute"),
    "budgets": ("bench.budgets.run", "one key's token budget shared by 4 replicas on Redis: any minute, kill -9, Redis stopped"),
    "sim-profile": ("bench.simcheck.profile", "the simulated engine's TTFT and ITL by concurrency, in virtual time"),
    "estimate": ("bench.estimate.run", "the prompt estimate beside a real tokenizer by kind of text, learnt ratios, what /tokenize per request costs"),
    "half-dead": ("bench.health.run", "a half-dead engine (/health fine, work hung) per health_check, in virtual time: requests that pay the deadline, probes' cost"),
}


def usage() -> str:
    width = max(map(len, DRIVERS))
    rows = [f"    python -m bench {name:<{width}}  {what}" for name, (_, what) in DRIVERS.items()]
    return "\n".join([__doc__.strip(), "", *rows])


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in DRIVERS:
        print(usage())
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(DRIVERS[argv[0]][0])
    result: int = module.main(list(argv[1:]))
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
