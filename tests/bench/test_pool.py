"""The load generators' connection pool: a connection idle past the servers' keep-alive is never reused."""

from __future__ import annotations

import time

import pytest

from bench.harness.client import STALE_IDLE_S, ConnectionPool
from bench.harness.open_loop import TokenClient, TokenPool


def test_a_connection_idle_past_the_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])  # the pool's clock; monkeypatch restores it
    pool = ConnectionPool(9)
    first = pool.take()
    pool.give_back(first)
    now[0] += STALE_IDLE_S - 0.5
    assert pool.take() is first  # fresh enough: reused
    pool.give_back(first)
    now[0] += STALE_IDLE_S
    second = pool.take()
    assert second is not first and pool.opened == 2  # the stale one is left for aclose()
    assert STALE_IDLE_S < 5.0  # below the simulator's (and vLLM's uvicorn) keep-alive timeout


def test_a_token_pool_makes_token_clients() -> None:
    assert isinstance(TokenPool(9).take(), TokenClient)
