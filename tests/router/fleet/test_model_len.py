"""A pool's max_model_len asked of its engines (GET /v1/models) when the config leaves it out.

Real sockets and simulated engines throughout: the engines report their
``max_model_len`` as vLLM does, in ``GET /v1/models``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from tailguard.router.config import load_config, parse_config
from tailguard.router.fleet import ModelLenError, ask_model_lens, ask_timeout
from tailguard.server.cli import main
from tailguard.sim import Engine, SimApp
from tailguard.sim.app import SimResponse
from tailguard.sim.http import Handler
from tests.e2e.test_reload import toml as reload_toml
from tests.helpers.engines import MODEL
from tests.helpers.router import INTERACTIVE_URL, router_over_engines
from tests.helpers.sockets import QUICK, Backends, engines_on_sockets, eventually, tailguard
from tests.router.fleet.test_discovery import HOSTS, NAME, dns_server, pods, toml as dns_toml, urls
from tests.router.fleet.test_rebalance import CAP, SPARE_URL, interactive_load, movable_config

MESSAGES = [{"role": "user", "content": "hello"}]


def toml(
    interactive: list[str], batch: list[str], *, interactive_len: int | None = None, batch_len: int | None = 32768, extra: str = ""
) -> str:
    """Two pools; the interactive one leaves max_model_len out (asked of its engines) unless given."""
    return reload_toml(interactive, batch, extra=extra, interactive_len=interactive_len, batch_len=batch_len)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed: a connection to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


async def test_two_engines_that_disagree_give_the_pool_the_smaller_value_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with engines_on_sockets([QUICK, QUICK.replace(max_model_len=16384), QUICK.replace(max_model_len=16384)]) as backends:
        a, b, c = backends.urls
        path = tmp_path / "config.toml"
        # interactive keeps its written 20000 although its engine says 16384: the file's value is an override
        path.write_text(toml([c], [a, b], interactive_len=20000, batch_len=None, extra="[limits]\noutput_cap_tokens = 20000\n"))
        async with tailguard(load_config(path), path) as running:
            interactive, batch = running.router.config.pool("interactive"), running.router.config.pool("batch")
            assert (interactive.max_model_len, interactive.max_model_len_configured) == (20000, True)
            assert (batch.max_model_len, batch.max_model_len_configured) == (16384, False)
            assert any(f"{a} 32768, {b} 16384" in m and "the smallest, 16384" in m for m in messages(caplog)), messages(caplog)
            async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
                limits = (await http.get("/v1/limits")).json()
                assert {p["name"]: p["max_model_len"] for p in limits["pools"]} == {"interactive": 20000, "batch": 16384}
                # The router refuses what the smaller engine could not hold, before any engine sees it.
                too_long = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16384})
                assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
                assert "16384-token context" in too_long.json()["error"]["message"]
                fits = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8})
                assert fits.status_code == 200
                assert (await http.get("/health")).json()["pools"]["batch"]["endpoints"] == {a: "up", b: "up"}


def test_an_unreachable_endpoint_and_no_value_refuse_the_start_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    path = tmp_path / "config.toml"
    path.write_text(toml([f"http://127.0.0.1:{port}"], [f"http://127.0.0.1:{closed_port()}"]))
    assert main(["serve", "--config", str(path), "--no-grpc", "--log-level", "CRITICAL"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "tailguard: pools.interactive.max_model_len is not set and no endpoint of pool interactive reported one"
        f" in GET /v1/models (http://127.0.0.1:{port}: ConnectError"
    ), err
    assert err.endswith("; set it in the config, or start the engines first\n"), err


async def test_an_endpoint_that_never_answers_is_given_up_on_after_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        await trio.sleep_forever()
        raise AssertionError

    async with engines_on_sockets([hang]) as backends:
        config = parse_config(toml(backends.urls, [f"http://127.0.0.1:{closed_port()}"]))
        start = trio.current_time()
        with pytest.raises(ModelLenError) as refused:
            await ask_model_lens(config)
        assert trio.current_time() - start == pytest.approx(ask_timeout(config), abs=0.1)
        (problem,) = refused.value.problems
        assert f"{backends.urls[0]}: no answer in {ask_timeout(config):g} s" in problem


async def test_a_discovered_value_below_the_input_cap_is_refused() -> None:
    async with engines_on_sockets([QUICK.replace(max_model_len=4096, kv_cache_tokens=100_000)]) as backends:
        config = parse_config(toml(backends.urls, [f"http://127.0.0.1:{closed_port()}"]))
        with pytest.raises(ModelLenError) as refused:
            await ask_model_lens(config)
        assert str(refused.value) == (
            "pools.interactive.max_model_len (as pool interactive's endpoints report it): 4096 cannot hold a prompt"
            " of limits.input_cap_tokens 8192 plus one output token (needs >= 8193)"
        )


async def test_a_reload_asks_again_and_takes_a_changed_value(tmp_path: Path, caplog: pytest.LogCaptureFixture, two_engines: Backends) -> None:
    a, b = two_engines.urls
    path = tmp_path / "config.toml"
    path.write_text(toml([a], [b]))
    async with tailguard(load_config(path), path) as running:
        assert running.reloader is not None
        assert running.router.config.pool("interactive").max_model_len == 32768
        engine = two_engines.engines[0]
        assert engine is not None
        engine.params = engine.params.replace(max_model_len=16384)  # the engine restarted with --max-model-len 16384
        assert await running.reloader.reload()  # the file is unchanged: the engine's answer is the change
        assert running.router.config.pool("interactive").max_model_len == 16384
        assert any("pools.interactive.max_model_len 32768->16384" in m for m in messages(caplog, logging.INFO))
        assert await running.reloader.reload()
        assert any("nothing changed" in m for m in messages(caplog, logging.INFO))


async def test_a_reload_whose_pool_cannot_be_asked_keeps_the_running_config(tmp_path: Path, caplog: pytest.LogCaptureFixture, two_engines: Backends) -> None:
    a, b = two_engines.urls
    path = tmp_path / "config.toml"
    path.write_text(toml([a], [b]))
    async with tailguard(load_config(path), path) as running:
        assert running.reloader is not None
        digest = running.router.config.digest
        gone = f"http://127.0.0.1:{closed_port()}"
        path.write_text(toml([gone], [b]))
        assert not await running.reloader.reload()
        assert running.reloader.reloads_failed == 1
        assert running.router.config.digest == digest
        assert [e.url for e in running.router.config.pool("interactive").endpoints] == [a]
        refused = [m for m in messages(caplog, logging.ERROR) if "config reload refused" in m]
        assert refused and "pools.interactive.max_model_len is not set and no endpoint of pool interactive reported one" in refused[0]
        assert gone in refused[0]
        async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
            assert (await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8})).status_code == 200


def quiet_until_told(engine: Engine, reported: list[int | None]) -> Handler:
    """A simulated engine whose GET /v1/models says nothing (404) while ``reported[0]`` is None, else that value."""
    app = SimApp(engine, model=MODEL)

    async def handle(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path == "/v1/models":
            if reported[0] is None:
                return SimResponse.json(404, {"error": {"message": "not here"}})
            engine.params = engine.params.replace(max_model_len=reported[0])
        return await app.handle(method, path, headers, body)

    return handle


async def test_an_endpoint_that_joins_unasked_serves_only_once_it_reports_enough(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Neither at start nor later does an endpoint serve a discovered value it has not confirmed."""
    late = Engine(QUICK)
    reported: list[int | None] = [None]
    async with trio.open_nursery() as nursery:
        await nursery.start(late.run)
        async with engines_on_sockets([QUICK, quiet_until_told(late, reported), QUICK]) as backends:
            a, silent, b = backends.urls
            path = tmp_path / "config.toml"
            path.write_text(toml([a, silent], [b]))
            config = load_config(path)
            async with tailguard(config, path) as running:
                assert running.router.config.pool("interactive").max_model_len == 32768
                assert any(f"{silent} did not report a max_model_len" in m for m in messages(caplog))

                async def states() -> dict[str, str]:
                    async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
                        body = (await http.get("/health")).json()
                    return dict(body["pools"]["interactive"]["endpoints"])

                assert await states() == {a: "up", silent: "unverified"}
                async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
                    for _ in range(6):
                        assert (await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})).status_code == 200
                assert late.statistics().finished_total == 0  # kept out: every request went to a

                reported[0] = 16384  # it answers now, with less than the pool's value: still out
                await running.router.check_health()
                assert await states() == {a: "up", silent: "unverified"}
                assert any(f"{silent} reports max_model_len 16384, less than pool interactive's 32768" in m for m in messages(caplog))

                reported[0] = 32768  # restarted with enough: it serves
                await running.router.check_health()
                assert await states() == {a: "up", silent: "up"}
                async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
                    async with trio.open_nursery() as clients:
                        for _ in range(8):
                            clients.start_soon(functools.partial(http.post, "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}))
                await eventually(lambda: late.statistics().finished_total > 0)
        nursery.cancel_scope.cancel()


async def test_a_new_dns_address_serves_a_discovered_pool_only_once_it_reports_enough(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with dns_server() as (zone, dns_port):
        async with pods(HOSTS) as fleet:
            first, short, third = HOSTS
            fleet.engines[short].params = fleet.engines[short].params.replace(max_model_len=16384)
            zone.set(NAME, [first])
            path = tmp_path / "config.toml"
            path.write_text(dns_toml(dns_port, fleet.port).replace("max_model_len = 32768\n", ""))  # asked at start: first's 32768
            async with tailguard(load_config(path), path) as running:
                assert running.router.config.pool("latency").max_model_len == 32768

                def states() -> dict[str, str]:
                    return dict(running.router.health()["pools"]["latency"]["endpoints"])

                assert states() == {f"http://{first}:{fleet.port}": "up"}
                zone.set(NAME, [first, short, third])  # two pods join; nobody has asked them yet
                await eventually(lambda: set(states()) == urls(fleet.port, first, short, third) and "unknown" not in states().values())
                assert set(states().values()) == {"up", "unverified"}  # probed at once, but nobody asked their context length
                assert [u for u, s in states().items() if s == "up"] == [f"http://{first}:{fleet.port}"]
                await running.router.check_health()  # a health check asks them
                assert states() == {
                    f"http://{first}:{fleet.port}": "up", f"http://{short}:{fleet.port}": "unverified", f"http://{third}:{fleet.port}": "up"
                }
                assert any(f"http://{short}:{fleet.port} reports max_model_len 16384, less than pool latency's 32768" in m for m in messages(caplog))


def test_check_config_says_the_value_will_be_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text(toml([f"http://127.0.0.1:{closed_port()}"], [f"http://127.0.0.1:{closed_port()}"]))
    assert main(["check-config", "--config", str(path)]) == 0  # offline: nothing is asked
    out = capsys.readouterr().out
    assert "max_model_len       asked of the endpoints at start and on every reload (GET /v1/models: the smallest they report)" in out


async def test_rebalancing_moves_an_engine_only_into_a_pool_whose_value_it_reported(autojump_clock: trio.testing.MockClock) -> None:
    config = movable_config()
    interactive = dataclasses.replace(config.pool("interactive"), max_model_len_configured=False)  # as asked at start: 32768
    config = dataclasses.replace(config, pools=(interactive, config.pool("batch")))
    async with router_over_engines(config) as fleet, trio.open_nursery() as background:
        await background.start(fleet.router.run)
        await fleet.router.check_health()  # asks interactive's own endpoint, which reports 32768
        assert fleet.router.health()["pools"]["interactive"]["endpoints"] == {INTERACTIVE_URL: "up"}
        fleet.router.note_model_lens({SPARE_URL: 16384})
        await interactive_load(fleet.router, 20.0, 3 * CAP, [])  # starved, but the spare engine is too short for it
        assert fleet.router.statistics().moves == {}
        fleet.router.note_model_lens({SPARE_URL: 32768})  # a reload's round heard it restarted with enough
        await interactive_load(fleet.router, 20.0, 3 * CAP, [])
        assert fleet.router.statistics().moves == {("batch", "interactive"): 1}
        assert fleet.router.health()["pools"]["interactive"]["endpoints"][SPARE_URL] == "up"
        background.cancel_scope.cancel()
