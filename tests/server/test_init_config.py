"""``tailguard init`` against simulated engines on real sockets: the file it writes loads and says what they serve."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from tailguard.router.config import load_config
from tailguard.server.cli import main as cli_main
from tailguard.server.init_config import EngineReport, InitError, starting_config
from tailguard.sim import PROFILES, EngineSpec, serve_engine

MODEL = "acme/Llama-3.1-8B-Instruct"


@asynccontextmanager
async def engines(*specs: tuple[str, int], api_key: str | None = None) -> AsyncIterator[list[str]]:
    """Simulated engines serving (model, max_model_len) on free loopback ports (with vLLM's --api-key); their base URLs."""
    async with trio.open_nursery() as nursery:
        urls = []
        for model, max_model_len in specs:
            params = PROFILES["latency"].replace(max_model_len=max_model_len)
            spec = EngineSpec(port=0, params=params, model=model, api_key=api_key)
            port = await nursery.start(partial(serve_engine, spec))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
        nursery.cancel_scope.cancel()


async def init(*argv: str) -> int:
    """``tailguard init ARGV`` as the command runs it (its own trio.run), in a thread beside the engines."""
    return await trio.to_thread.run_sync(cli_main, ["init", "--timeout", "10", *argv])


async def test_init_writes_a_config_that_loads_with_the_model_and_context_the_engine_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    async with engines((MODEL, 16384)) as (url,):
        assert await init("--endpoint", url, "--output", str(path)) == 0
    config = load_config(path)
    (pool,) = config.pools
    assert pool.models == (MODEL,) and pool.max_model_len == 16384 and pool.max_model_len_configured
    assert [(e.url, e.max_concurrency) for e in pool.endpoints] == [(url, 256)]
    assert [(c.name, c.pool, c.priority) for c in config.classes] == [("interactive", pool.name, 0), ("batch", pool.name, 1)]
    out = capsys.readouterr().out
    assert f"check-config --config {path}" in out
    text = path.read_text()
    # D9: vLLM does not report --max-num-seqs; the seats are a guess, and both the file and the summary say so.
    assert "max_concurrency 256 per engine ASSUMED" in out and "# ASSUMED: max_concurrency = 256" in text
    assert all(line.startswith("#") or not line or line[0] in "[ ]" or "=" in line for line in text.splitlines())


async def test_every_engine_is_in_the_pool_at_the_smallest_context(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    async with engines((MODEL, 16384), (MODEL, 12288)) as urls:
        assert await init(*(word for url in urls for word in ("--endpoint", url)), "--output", str(path), "--max-concurrency", "64") == 0
    (pool,) = load_config(path).pools
    assert [(e.url, e.max_concurrency) for e in pool.endpoints] == [(url, 64) for url in urls]
    assert pool.max_model_len == 12288 and pool.max_concurrency == 128
    assert "ASSUMED" not in path.read_text()  # given, not guessed


async def test_a_small_context_gets_an_input_cap_that_fits_it(tmp_path: Path) -> None:
    """The default input cap (8192) would refuse the file for a 4096-token engine: init writes one that loads."""
    path = tmp_path / "config.toml"
    async with engines((MODEL, 4096)) as (url,):
        assert await init("--endpoint", url, "--output", str(path)) == 0
    config = load_config(path)
    assert config.pools[0].max_model_len == 4096
    assert config.limits.input_cap_tokens + config.limits.output_cap_tokens <= 4096


async def test_an_existing_file_is_kept_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text("# mine\n")
    async with engines((MODEL, 16384)) as (url,):
        assert await init("--endpoint", url, "--output", str(path)) == 2
        assert path.read_text() == "# mine\n" and "--force" in capsys.readouterr().err
        assert await init("--endpoint", url, "--output", str(path), "--force") == 0
    assert load_config(path).pools[0].models == (MODEL,)


async def test_an_engine_that_cannot_be_reached_is_named_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{closed.getsockname()[1]}"
        async with engines((MODEL, 16384)) as (up,):
            assert await init("--endpoint", up, "--endpoint", down, "--output", str(path)) == 2
    err = capsys.readouterr().err
    assert f"{down}: cannot reach it" in err and up not in err
    assert not path.exists()


async def test_engines_serving_different_models_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with engines((MODEL, 16384), ("other-model", 16384)) as urls:
        assert await init(*(word for url in urls for word in ("--endpoint", url)), "--output", str(tmp_path / "c.toml")) == 2
    err = capsys.readouterr().err
    assert "serve different models" in err and MODEL in err and "other-model" in err


async def test_the_engines_key_is_sent_and_its_variable_named_in_the_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("TG_TEST_VLLM_KEY", "s3cret")
    async with engines((MODEL, 16384), api_key="s3cret") as (url,):
        assert await init("--endpoint", url, "--output", str(path)) == 2
        assert "401" in capsys.readouterr().err and not path.exists()
        assert await init("--endpoint", url, "--output", str(path), "--api-key-env", "TG_TEST_VLLM_KEY") == 0
    assert 'api_key_env = "TG_TEST_VLLM_KEY"' in path.read_text() and "s3cret" not in path.read_text()
    (pool,) = load_config(path).pools
    assert pool.models == (MODEL,) and pool.access.api_key_env == "TG_TEST_VLLM_KEY"
    assert all(endpoint.access.authorization == {"authorization": "Bearer s3cret"} for endpoint in pool.endpoints)


def test_an_unset_key_variable_is_refused_before_any_engine_is_asked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        cli_main(["init", "--endpoint", "http://vllm-0:8000", "--api-key-env", "TG_TEST_SURELY_UNSET"])
    assert exit.value.code == 2 and "TG_TEST_SURELY_UNSET" in capsys.readouterr().err


def report(url: str, models: Sequence[str], max_model_len: int | None) -> EngineReport:
    return EngineReport(url, tuple(models), max_model_len)


def test_an_engine_that_reports_no_context_leaves_max_model_len_to_be_asked_at_start() -> None:
    text = starting_config([report("http://127.0.0.1:8001", [MODEL], None)], max_concurrency=8, api_key_env=None)
    assert "\nmax_model_len" not in text and "asks them again at start" in text


def test_a_context_no_config_can_hold_is_an_init_error_not_a_broken_file() -> None:
    with pytest.raises(InitError, match="would not load"):
        starting_config([report("http://127.0.0.1:8001", [MODEL], 1)], max_concurrency=8, api_key_env=None)
