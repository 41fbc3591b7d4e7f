"""``python -m bench prefix``: the shared-prefix benchmark (workloads, set-ups, runner, report)."""
