"""The access line's prefix_group: requests that shared a prefix key share it, others differ, no text is logged, and advise replays it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from tailguard.server.advise.access_log import read_access_log
from tailguard.server.advise.prefixes import with_prefixes
from tailguard.server.log_format import JsonFormatter
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, eventually, tailguard

# Over the key's 1024 leading characters (16 blocks of 16 tokens, 4 characters a token): the key reads no further.
MANUAL = "Step one: check the valve. Step two: log the pressure. Step three: report. " * 16
POLICY = "Refunds are paid within thirty days of a claim, once the receipt is checked. " * 16


def access_lines(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    return {r.fields["request_id"]: r.fields for r in caplog.records if hasattr(r, "fields")}


async def test_equal_prefixes_log_equal_groups_and_different_ones_differ(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    sent: dict[str, dict[str, object]] = {
        "manual-a": {"messages": [{"role": "system", "content": MANUAL}, {"role": "user", "content": "Which step is first?"}]},
        "manual-b": {"messages": [{"role": "system", "content": MANUAL}, {"role": "user", "content": "How many steps?"}]},
        "manual-c": {"messages": [{"role": "system", "content": MANUAL}, {"role": "user", "content": "And the last one?"}]},
        "policy": {"messages": [{"role": "system", "content": POLICY}, {"role": "user", "content": "How long?"}]},
        "hint-a": {"messages": [{"role": "user", "content": "Hello there."}], "prompt_cache_key": "tenant-7"},
        "hint-b": {"messages": [{"role": "user", "content": "Something else."}], "prompt_cache_key": "tenant-7"},
    }
    async with engines_on_sockets([QUICK, QUICK], prompt_tokens_details=True) as backends:
        config = two_pool_config(interactive_urls=backends.urls[:1], batch_urls=backends.urls[1:])
        async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            with caplog.at_level(logging.INFO, logger="tailguard.access"):
                for request_id, body in sent.items():
                    answer = await client.post("/v1/chat/completions", json={**body, "max_tokens": 4}, headers={"x-request-id": request_id})
                    assert answer.status_code == 200
                await eventually(lambda: set(sent) <= set(access_lines(caplog)))
    lines = access_lines(caplog)
    groups = {request_id: lines[request_id]["prefix_group"] for request_id in sent}
    assert all(isinstance(g, str) and len(g) == 16 and int(g, 16) >= 0 for g in groups.values())
    assert groups["manual-a"] == groups["manual-b"] == groups["manual-c"] and groups["hint-a"] == groups["hint-b"]  # a prefix, a hint
    assert len({groups["manual-a"], groups["policy"], groups["hint-a"]}) == 3
    assert all(lines[r]["uncached_tokens"] is None for r in sent)  # no class bounds uncached tokens here
    logged = " ".join(str(v) for line in lines.values() for v in line.values())
    assert "valve" not in logged and "Refunds" not in logged and "tenant-7" not in logged  # digests, never the text or the hint
    # tailguard advise reads the JSON lines back: the manual's requests replay with one shared text as long as
    # what the engine found cached for them, the hint's are placed as one key but share no text (none was cached).
    log = tmp_path / "tailguard.log"
    formatter = JsonFormatter()
    log.write_text("".join(formatter.format(r) + "\n" for r in caplog.records if r.name == "tailguard.access"))
    arrivals, seen, usage = read_access_log(log, "interactive", 60.0)
    assert usage.used == len(sent) == len(arrivals)
    cached = lines["manual-c"]["cached_tokens"]
    assert isinstance(cached, int) and cached >= 256 and lines["manual-b"]["cached_tokens"] == cached
    replayed, sharing = with_prefixes(arrivals, seen)
    assert (sharing.grouped, sharing.groups, sharing.shared, sharing.tokens_p50) == (5, 2, 3, cached)
    manual = [a for a, s in zip(replayed, seen) if s.group == groups["manual-a"]]
    assert len({a.text[: 4 * cached] for a in manual if a.text}) == 1 and len({a.prefix_hint for a in manual}) == 1
