"""A small valid config.toml text, and the edits and refusals the config tests make of it."""

from __future__ import annotations

import pytest

from tailguard.router.config import ConfigError, parse_config

# A small valid configuration; each rule test changes one thing in it.
BASE = """\
[timeouts]
end_to_end_timeout = 120

[pools.interactive]
max_concurrency = 64
max_queue = 256
max_model_len = 32768
models = ["m"]
endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]

[pools.batch]
max_concurrency = 256
max_queue = 512
max_model_len = 32768
models = ["m"]
endpoints = [
    { url = "http://127.0.0.1:8002", max_concurrency = 128 },
    { url = "http://127.0.0.1:8003", max_concurrency = 128 },
]

[classes.interactive]
pool = "interactive"
max_prompt_tokens = 500
max_output_tokens = 128
queue_timeout = 3.0
priority = 0

[classes.batch]
pool = "batch"
queue_timeout = 30.0
priority = 1
"""


def edit(old: str, new: str, text: str = BASE) -> str:
    """``text`` with the one occurrence of ``old`` replaced (a guard against stale tests)."""
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def problems_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.problems, "a ConfigError must carry at least one problem"
    return info.value.problems
