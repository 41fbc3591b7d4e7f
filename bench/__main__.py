"""``python -m bench <benchmark>``: the benchmarks, one command each.

    python -m bench tail       short-request P99 under mixed load, set-ups side by side
    python -m bench overhead   what the router adds per request and per relayed event
    python -m bench sweep      the policy in virtual time: loads x set-ups x splits
    python -m bench chaos      killed, hung and broken engines, hostile clients, reloads: what must hold
    python -m bench hold       RSS while holding 10,000 HTTP SSE streams; GC pauses under relay, per GC threshold
    python -m bench cluster    replicas sharing caps on Redis: caps under load, kill -9, Redis down (issue 13)

Each prints its parameters and numbers, writes JSON (and plots) under
``bench/results/``, and takes ``--help``.
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "tail": "bench.tail",
    "overhead": "bench.overhead",
    "sweep": "bench.sweep",
    "chaos": "bench.chaos",
    "hold": "bench.hold",
    "cluster": "bench.cluster",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[argv[0]])
    result: int = module.main(argv[1:])
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
