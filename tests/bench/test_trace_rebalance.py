"""The virtual fleet rebalances as the router does (seats or whole engines, in virtual time), and the trace grid reports it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench.trace.run import main
from bench.trace.setups import rebalancing
from tailguard.router.config import RebalanceConfig
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.replay.point import Point, PointResult, run_point
from tailguard.server.advise.replay.setups import Setup, disaggregated

CAP = 4  # seats the router gives each endpoint: a few long requests fill a pool


def _capped(setup: Setup) -> Setup:
    """``setup`` with every endpoint (and pool) capped at CAP seats per engine, so a burst queues in the router."""
    assert setup.config is not None
    pools = tuple(
        dataclasses.replace(
            pool,
            endpoints=tuple(dataclasses.replace(e, max_concurrency=CAP) for e in pool.endpoints),
            max_concurrency=CAP * len(pool.endpoints),
        )
        for pool in setup.config.pools
    )
    return dataclasses.replace(setup, config=dataclasses.replace(setup.config, pools=pools))


def _burst(setup: Setup, count: int = 40) -> PointResult:
    """``count`` long requests (batch class) within 4 s: the batch pool queues, the interactive pool idles."""
    arrivals = tuple(Arrival(i, 0.1 * i, "long", True, prompt_tokens=1000, max_tokens=300) for i in range(count))
    return run_point(Point(setup, 1.0, count / 4, 0.0, arrivals[-1].at + 1, 0, arrivals))


SETTINGS = RebalanceConfig(interval=1.0, hold_time=2.0, cooldown=2.0)


def test_seat_shares_move_and_the_share_reaches_its_engine() -> None:
    # No lending (disaggregated's pools lend nothing): a long request reaches the interactive engine only through a share.
    setup = rebalancing(_capped(disaggregated(1, 1)), dataclasses.replace(SETTINGS, seat_step=0.5), name="shares")
    result = _burst(setup)
    moved = result.rebalancing
    assert moved is not None and moved.seat_moves >= 1 and moved.whole_moves == 0
    assert sum(moved.pool_seats.values()) == 2 * CAP and moved.pool_seats["batch"] > CAP
    long = result.stats("long")
    assert long is not None and long.ok == long.n == 40


def test_a_share_serves_on_the_in_process_engine() -> None:
    shares = dataclasses.replace(SETTINGS, seat_step=0.5)
    moved = _burst(rebalancing(_capped(disaggregated(1, 1)), shares, name="shares"))
    unmoved = _burst(rebalancing(_capped(disaggregated(1, 1)), dataclasses.replace(shares, hold_time=1e6), name="never"))
    assert unmoved.rebalancing is not None and unmoved.rebalancing.seat_moves == 0
    # The share's seats ran batch requests on the interactive engine: the burst ends sooner than on the batch engine alone.
    assert moved.simulated_s < unmoved.simulated_s


def test_whole_engines_move_when_the_donor_keeps_one() -> None:
    setup = rebalancing(_capped(disaggregated(2, 1)), SETTINGS, name="moves")
    moved = _burst(setup).rebalancing
    assert moved is not None and moved.whole_moves >= 1 and moved.seat_moves == 0
    assert moved.pool_seats == {"interactive": CAP, "batch": 2 * CAP}


def test_a_setup_with_nothing_movable_runs_no_rebalancing() -> None:
    assert _burst(_capped(disaggregated(1, 1)), count=4).rebalancing is None


def test_the_grid_reports_rebalancing_under_its_own_name(tmp_path: Path) -> None:
    argv = ["--traces", "sharegpt", "--engines", "2", "--loads", "0.9", "--requests", "40", "--jobs", "1"]
    assert main([*argv, "--setups", "tailguard-moves,tailguard-shares", "--out", str(tmp_path), "--name", "shares"]) == 0
    assert not (tmp_path / "trace.md").exists()
    text = (tmp_path / "shares.md").read_text()
    assert "## Rebalancing" in text and "| tailguard 1:1, seat shares 0.25 |" in text and "hold_time 5 s" in text
    point = json.loads((tmp_path / "shares.json").read_text())["points"][0]
    assert set(point["rebalancing"]) == {"tailguard-moves", "tailguard-shares"}
    assert sum(point["rebalancing"]["tailguard-shares"]["pool_seats"].values()) == 512  # two engines of 256 seats, however split
