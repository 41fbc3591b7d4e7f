"""Hot reload through the real process: SIGHUP and file changes, under live traffic."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tailguard.router.config import Config
from tests.helpers.engines import MODEL
from tests.helpers.sockets import QUICK, engines_on_sockets, eventually, tailguard

MESSAGES = [{"role": "user", "content": "Summarise the meeting notes."}]


def toml(
    interactive: list[str],
    batch: list[str],
    *,
    poll: float = 0.0,
    extra: str = "",
    cap: int = 4,
    interactive_len: int | None = 32768,
    batch_len: int | None = 32768,
) -> str:
    """Two pools over the given endpoints, ``cap`` seats each, and the shipped classes.

    A ``*_len`` of None leaves that pool's max_model_len out (asked of its engines).
    """

    def endpoints(urls: list[str]) -> str:
        return ", ".join(f'{{ url = "{u}", max_concurrency = {cap} }}' for u in urls)

    def model_len(length: int | None) -> str:
        return "" if length is None else f"max_model_len = {length}\n"

    return f"""
[server]
http_listen = "127.0.0.1:0"
reload_poll_interval = {poll}

[pools.interactive]
max_concurrency = {cap * len(interactive)}
max_queue = 100
{model_len(interactive_len)}models = ["{MODEL}"]
endpoints = [{endpoints(interactive)}]

[pools.batch]
max_concurrency = {cap * len(batch)}
max_queue = 100
{model_len(batch_len)}models = ["{MODEL}"]
simulate_profile = "throughput"
endpoints = [{endpoints(batch)}]

[classes.interactive]
pool = "interactive"
max_prompt_tokens = 500
max_output_tokens = 128
queue_timeout = 10.0
priority = 0

[classes.batch]
pool = "batch"
queue_timeout = 20.0
priority = 1
{extra}
"""


async def test_sighup_moves_an_endpoint_under_traffic_and_refuses_a_broken_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tailguard.router.config import load_config

    slower = QUICK.replace(base_ms=3.0)
    async with engines_on_sockets([slower, slower, slower]) as backends:
        a, b, c = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b, c]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            statuses: list[int] = []
            pools_of_c: set[str] = set()

            async def client(i: int) -> None:
                async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:
                    for _j in range(12):
                        max_tokens = 16 if i % 2 else 200
                        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens})
                        statuses.append(response.status_code)

            async def observe() -> None:
                while True:
                    for pool in running.router.statistics().pools:
                        if any(e.url == c and e.in_flight for e in running.router.pool(pool.name).endpoints):
                            pools_of_c.add(pool.name)
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()

                async def watch() -> None:
                    with watcher:
                        await observe()

                nursery.start_soon(watch)
                async with trio.open_nursery() as clients:
                    for i in range(8):
                        clients.start_soon(client, i)
                    await eventually(lambda: backends.engines[2].statistics().running > 0)  # type: ignore[union-attr]
                    path.write_text(toml([a, c], [b]))
                    os.kill(os.getpid(), signal.SIGHUP)
                    await eventually(lambda: running.reloader.reloads_ok == 1)  # type: ignore[union-attr]
                    assert running.router.statistics().pool("interactive").max_concurrency == 8

                    # A broken file is refused, logged, and the running config stays.
                    digest = running.router.config.digest
                    path.write_text(toml([a], [b, c], extra="[classes.batch.oops]\nx = 1\n").replace("queue_timeout = 20.0", "queue_timeout = 500.0"))
                    os.kill(os.getpid(), signal.SIGHUP)
                    await eventually(lambda: running.reloader.reloads_failed == 1)  # type: ignore[union-attr]
                    assert running.router.config.digest == digest
                    refused = [r.getMessage() for r in caplog.records if r.name == "tailguard.reload"]
                    assert any("refused" in m and "classes.batch.oops" in m for m in refused), refused
                watcher.cancel()
            assert statuses and set(statuses) == {200}, statuses
            assert len(statuses) == 96
            assert pools_of_c == {"interactive", "batch"}


async def test_a_changed_file_is_picked_up_without_a_signal(tmp_path: Path) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b], poll=0.05))
        async with tailguard(load_config(path), path) as running, httpx.AsyncClient(base_url=running.http_url) as http:
            assert (await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16})).headers["x-tailguard-pool"] == "interactive"
            path.write_text(toml([a], [b], poll=0.05).replace("max_output_tokens = 128", "max_output_tokens = 8"))
            await eventually(lambda: running.reloader.reloads_ok == 1)  # type: ignore[union-attr]
            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16})
            assert response.headers["x-tailguard-pool"] == "batch"
            limits = (await http.get("/v1/limits")).json()
            assert limits["classes"][0]["max_output_tokens"] == 8


async def test_reload_warns_of_inverted_timeout_layers_and_counts_results(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            path.write_text(toml([a], [b], extra="[timeouts]\nend_to_end_timeout = 120\nfront_proxy_timeout = 60\n"))
            assert await running.reloader.reload()
            warnings = [r.getMessage() for r in caplog.records if r.name == "tailguard" and r.levelname == "WARNING"]
            assert any("front_proxy_timeout (60 s)" in m and "end_to_end_timeout (120 s)" in m for m in warnings), warnings
            path.write_text("[pools.nope]\n")
            assert not await running.reloader.reload()
            page = running.metrics.render().decode()
            assert 'tailguard_config_reloads_total{result="ok"} 1.0' in page
            assert 'tailguard_config_reloads_total{result="failed"} 1.0' in page
            assert f'tailguard_config_info{{digest="{running.router.config.digest}"}} 1.0' in page


# -- issue 14, papercut 6: restart-only keys, a live poll interval, what a reload changed ------------


def reload_lines(caplog: pytest.LogCaptureFixture, level: str = "INFO") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tailguard.reload" and r.levelname == level]


async def test_a_reload_names_each_key_that_needs_a_restart_and_applies_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            started = running.router.config.server
            changed = toml([a], [b], cap=6).replace(
                'http_listen = "127.0.0.1:0"',
                'http_listen = "127.0.0.1:0"\ngrpc_listen = "127.0.0.1:50999"\nworkers = 2\nkeep_alive_timeout = 5.0',
            )
            path.write_text(changed + '\n[cluster]\nredis_url = "redis://127.0.0.1:1/0"\n')
            with caplog.at_level(logging.INFO, logger="tailguard.reload"):
                assert await running.reloader.reload()
            [warning] = reload_lines(caplog, "WARNING")
            named = warning.removeprefix("config reload: ").split(" changed in ")[0]
            assert named == "server.grpc_listen, server.workers, server.keep_alive_timeout, cluster", warning
            assert "only after a restart" in warning
            assert running.router.config.server == started and running.router.config.cluster is None  # still as started
            assert running.router.statistics().pool("interactive").max_concurrency == 6  # the rest applied


def test_the_readme_lists_exactly_the_restart_only_keys() -> None:
    import re

    from tailguard.server.reload import RESTART_ONLY

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    sentence = readme[readme.index("Keys that need a restart:") :]
    sentence = sentence[: sentence.index(". ")]
    listed = re.findall(r"`([a-z_.]+)`", sentence)
    assert listed == list(RESTART_ONLY)


async def test_reload_poll_interval_is_applied_live(tmp_path: Path) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b], poll=0))  # no polling: only a signal (here: reload()) reloads
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            path.write_text(toml([a], [b], poll=0.05))
            assert await running.reloader.reload()
            assert running.reloader.reloads_ok == 1
            path.write_text(toml([a], [b], poll=0.05, cap=5))  # no signal: the new interval's polling finds it
            await eventually(lambda: running.reloader.reloads_ok == 2)  # type: ignore[union-attr]
            assert running.router.statistics().pool("interactive").max_concurrency == 5


async def test_a_reload_logs_what_changed_and_an_unchanged_file_logs_that_nothing_did(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK, QUICK]) as backends:
        a, b, c = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b, c]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            with caplog.at_level(logging.INFO, logger="tailguard.reload"):
                path.write_text(toml([a, c], [b]).replace("max_output_tokens = 128", "max_output_tokens = 64"))
                os.kill(os.getpid(), signal.SIGHUP)
                await eventually(lambda: running.reloader.reloads_ok == 1)  # type: ignore[union-attr]
                os.kill(os.getpid(), signal.SIGHUP)  # the same file again
                await eventually(lambda: len(reload_lines(caplog)) == 2)
            changed, unchanged = reload_lines(caplog)
            assert changed.startswith(f"config reloaded from {path.absolute()} (digest {running.router.config.digest}): ")
            assert changed.endswith(
                f"endpoints {c} moved batch->interactive; caps pools.interactive.max_concurrency 4->8, "
                "pools.batch.max_concurrency 8->4; classes ~interactive"
            ), changed
            assert unchanged == f"config reload: {path.absolute()} is unchanged (digest {running.router.config.digest}); nothing changed"
            assert running.reloader.reloads_ok == 1


def test_the_summary_names_pools_endpoints_caps_classes_and_other_keys() -> None:
    from tailguard.router.config import parse_config
    from tailguard.server.reload import summarize

    def endpoints(*ports: int) -> str:
        return ", ".join(f'{{ url = "http://127.0.0.1:{p}", max_concurrency = 4 }}' for p in ports)

    def pool(name: str, *ports: int, queue: int = 10) -> str:
        return f'[pools.{name}]\nmax_concurrency = {4 * len(ports)}\nmax_queue = {queue}\nmax_model_len = 32768\nmodels = ["m"]\nendpoints = [{endpoints(*ports)}]\n'

    before = parse_config(pool("a", 1, 2) + pool("b", 3) + '[classes.x]\npool = "a"\nqueue_timeout = 1.0\npriority = 0\n')
    after = parse_config(
        pool("a", 1, queue=20) + pool("c", 3, 4)
        + '[classes.x]\npool = "c"\nqueue_timeout = 1.0\npriority = 0\n[limits]\noutput_cap_tokens = 512\n'
    )
    assert summarize(before, after) == (
        "pools +c -b; endpoints +http://127.0.0.1:4 (c), -http://127.0.0.1:2 (a), http://127.0.0.1:3 moved b->c; "
        "caps pools.a.max_concurrency 8->4, pools.a.max_queue 10->20; classes ~x; also limits.output_cap_tokens"
    )
    assert summarize(before, before) == "no setting changed"


async def test_start_and_reload_say_which_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tailguard.router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b]))
        with caplog.at_level(logging.INFO):
            async with tailguard(load_config(path), path):
                pass
        assert f"config loaded from {path.absolute()} (digest {load_config(path).digest})" in [r.getMessage() for r in caplog.records]


async def test_command_line_addresses_survive_a_reload_without_a_restart_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tailguard.router.config import load_config
    from tailguard.server.cli import _prepared, build_parser
    from tailguard.server.reload import ConfigReloader

    path = tmp_path / "config.toml"
    path.write_text(toml(["http://127.0.0.1:1"], ["http://127.0.0.1:2"]))
    args = build_parser().parse_args(["serve", "--http-listen", "127.0.0.1:18123", "--grpc-listen", "[::1]:18124", "--log-level", "debug"])
    prepare = _prepared(args, None)
    applied: list[Config] = []

    async def apply(new: Config) -> None:
        applied.append(new)

    reloader = ConfigReloader(path, prepare(load_config(path)), apply, prepare=prepare)
    path.write_text(toml(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], cap=5))
    with caplog.at_level(logging.INFO, logger="tailguard.reload"):
        assert await reloader.reload()
    assert reload_lines(caplog, "WARNING") == []
    [new] = applied
    assert (new.server.http_host, new.server.http_port, new.server.grpc_host, new.server.grpc_port) == ("127.0.0.1", 18123, "::1", 18124)
    assert new.logging.level == "DEBUG"
