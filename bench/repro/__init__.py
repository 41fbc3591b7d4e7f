"""Scripts that reproduce what ``python -m bench cluster`` found (``bench/results/cluster/findings.md``), and issue 32's
ledger sync cost with idle keys (``idle_keys``).

Each runs from the repository root with the project's venv on a real
redis-server: ``.venv/bin/python -m bench.repro.NAME``.
"""
