"""``python -m bench <driver> [--help | options]``: every benchmark, one command each.

A driver is a folder, ``bench/NAME/``, whose ``run.py`` has ``main(argv) ->
int`` and which is run as ``python -m bench NAME``: the registry below is
the only list, and a test holds it equal to the folders that have a
``run.py``. Each driver prints its parameters and numbers, writes its
results under ``bench/results/`` (``bench.harness.report``) and takes
``--help``. ``python -m bench`` alone lists them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# folder -> what it measures; the order is the listing's
DRIVERS: dict[str, str] = {
    "tail": "short-request P99 under mixed load, set-ups side by side",
    "quick_mixed": "the first tail run: one shared engine vs tailguard, the origin's mix",
    "overhead": "what the router adds per request and per relayed event, beside vllm-router",
    "router_overhead": "closed-loop HTTP latency and CPU per request, direct vs through tailguard",
    "pairs": "router_overhead against two commits' router, in alternating pairs",
    "grpc_overhead": "the gRPC front end: unary calls, streams, 10,000 open streams",
    "sse_check": "in process: what the HTTP relay's check of every SSE event costs per event",
    "sse_decoder": "the gRPC side's SSE decoder on a 64 MB line cut small, over merely keeping its bytes: linear or not",
    "hold": "RSS while holding 10,000 HTTP SSE streams; GC pauses under relay, per GC threshold",
    "prefix": "shared prefixes: tenants, conversations, RAG, Mooncake; placement side by side with vllm-router",
    "sweep": "the policy in virtual time: loads x set-ups x splits",
    "lendback": "where borrowed seats go (lend-back beside a batch engine's prefills), in virtual time",
    "trace": "real traces (Mooncake, ShareGPT lengths) in virtual time: per class vs round robin and a hand split",
    "chaos": "killed, hung and broken engines, hostile clients, reloads: what must hold",
    "cluster": "replicas sharing caps on Redis: caps under load, kill -9, Redis down",
    "workers": "serve --workers 2 beside --workers 1 and vllm-router: req/s, CPU per request",
    "sim_cpu": "the simulator's own CPU while streaming to many clients",
    "tenants": "two API keys on one small pool: fair shares vs FIFO under a burst, weighted shares backlogged",
    "retry": "the openai SDK's retries under 1.5x overload: computed Retry-After vs a fixed 1 s",
    "cardinality": "API keys rotated by reloads: /metrics size and lines, RSS after an idle minute",
    "budgets": "one key's token budget shared by 4 replicas on Redis: any minute, kill -9, Redis stopped",
    "sim_profile": "the simulated engine's TTFT and ITL by concurrency, in virtual time",
    "estimate": "the prompt estimate beside a real tokenizer by kind of text, learnt ratios, what /tokenize per request costs",
    "health": "a half-dead engine (/health fine, work hung) per health_check, in virtual time: requests that pay the deadline, probes' cost",
}


def usage() -> str:
    width = max(map(len, DRIVERS))
    rows = [f"    python -m bench {name:<{width}}  {what}" for name, what in DRIVERS.items()]
    return "\n".join([(__doc__ or "").strip(), "", *rows])


def main(argv: Sequence[str]) -> int:
    """Run ``bench.NAME.run.main`` with the rest of ``argv``; list the drivers on no name, ``-h`` or an unknown one (2)."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in DRIVERS:
        print(usage())
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"bench.{argv[0]}.run")
    result: int = module.main(list(argv[1:]))
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
