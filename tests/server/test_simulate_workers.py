"""``serve --workers N --simulate``: worker 0 starts the engines, the others wait for them (server/app.py, server/simulate.py).

A pool without ``max_model_len`` asks its engines at start; a worker that
asked before worker 0 had started them exited with status 2, and the
supervisor stopped every worker with it.
"""

from __future__ import annotations

import re
from functools import partial

import trio
import trio.testing

from tailguard.router.config import Config, parse_config
from tailguard.server.app import Running, serve
from tailguard.server.simulate import SimulatedFleet, wait_for_engines
from tailguard.server.workers import WorkerRole
from tailguard.sim import PROFILES
from tests.e2e.test_workers import free_run
from tests.helpers.process import ROOT, free_port


def shipped_without_max_model_len(http: int) -> Config:
    """The shipped config on free ports, its pools' ``max_model_len`` left to the engines."""
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{http}").replace(":8001", f":{free_port()}").replace(":8002", f":{free_port()}")
    text, removed = re.subn(r"(?m)^max_model_len = .*\n", "", text)
    assert removed == 2
    config = parse_config(text)
    assert not any(pool.max_model_len_configured for pool in config.pools)
    return config


async def test_worker_1_of_a_simulated_run_waits_for_worker_0s_engines_then_asks_them() -> None:
    http = free_run(3)  # the shared port and worker 1's own (http + 2)
    config = shipped_without_max_model_len(http)
    shutdown = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            worker_0 = SimulatedFleet(nursery)  # the engines, as worker 0 starts them: here, once worker 1 waits
            engines_up = trio.Event()

            async def start_engines_late() -> None:
                await trio.testing.wait_all_tasks_blocked()  # worker 1 is past its start, at the engines' ports
                await worker_0.ensure(config)  # fails if worker 1 took their ports itself
                engines_up.set()

            nursery.start_soon(start_engines_late)
            running: Running = await nursery.start(
                partial(serve, config, None, simulate=True, http_port=http, worker=WorkerRole(1, 2), shutdown=shutdown)
            )
            assert engines_up.is_set()  # it served only once worker 0's engines did, and started none of its own
            # It asked the engines once they listened: the pools have the value they report.
            expected = {pool.name: PROFILES[pool.simulate_profile].max_model_len for pool in config.pools}
            assert {pool.name: pool.max_model_len for pool in running.router.config.pools} == expected
            assert all(endpoint.healthy for endpoint in running.router.endpoints)
            shutdown.set()
            nursery.cancel_scope.cancel()


async def test_waiting_for_engines_is_bounded_and_names_the_silent_ones() -> None:
    config = shipped_without_max_model_len(free_port())
    with trio.fail_after(5):
        missing = await wait_for_engines(config, 0.2)
    assert sorted(missing) == sorted(endpoint.url for pool in config.pools for endpoint in pool.endpoints)
