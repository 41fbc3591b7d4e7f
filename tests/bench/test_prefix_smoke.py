"""bench prefix end to end, small: a few tenants' requests through tailguard to four real simulated engines, counted back from their /metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.harness.procs import log_tail
from bench.prefix.engines import kv_sizing
from bench.prefix.measure import RunSpec, run_setup
from bench.prefix.setups import TAILGUARD, describe
from bench.prefix.workloads import Spec, system_prompts, tenants

pytestmark = pytest.mark.trio


async def test_tenants_through_tailguard_hit_the_cache_and_every_request_is_counted(tmp_path: Path) -> None:
    spec = Spec(seed=5, load=0.5, warmup_s=0.2, seconds=1.0, tenants=3, unique_share=0.0)
    sizing = kv_sizing(sum(len(p) // 4 for p in system_prompts(spec)), 0.0)
    workload = tenants(dataclasses.replace(spec, kv_cache_tokens=sizing.kv_cache_tokens))
    assert len(workload.requests) >= 8
    run = RunSpec(time_scale=1.0, drain_s=5.0, kv_cache_tokens=sizing.kv_cache_tokens, seed=5, placement_ok=True, parallel=False)
    log_path = tmp_path / "log"
    try:
        with log_path.open("wb") as log:
            found = await run_setup(workload, describe(TAILGUARD, True), run, tmp_path, log)  # its default placement: no placement key
    except RuntimeError:
        print(log_tail(log_path))  # the simulator's and tailguard's stderr: why one did not start
        raise
    assert found.errors == 0 and found.cut == 0
    assert sum(found.engine_requests) == len(workload.requests)  # every request reached an engine and finished there
    assert found.hit_rate_run > 0.3  # three tenants' system prompts, cached after their first requests (on each engine, at worst)
    assert found.ttft_p50_ms > 0 and found.e2e_p99_ms >= found.ttft_p99_ms
    assert sum(found.placements.values()) == len(workload.requests)
