"""What ``pip install .`` (not editable) installs, and that it runs from any folder.

The repository keeps router/, server/ and bench/sim/ at its top level; the
wheel installs them as tailguard.router, tailguard.server and tailguard.sim
(pyproject's package-dir). These tests build the real wheel, install it into
a fresh virtual environment whose only other path is the dependencies
already installed here, and run the installed ``tailguard`` command from a
temporary folder, away from the checkout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .test_cli import config_on_free_ports, exited, free_port, until_healthy

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lives in the repository.
SOURCES = {"tailguard.router": ROOT / "router", "tailguard.server": ROOT / "server", "tailguard.sim": ROOT / "bench" / "sim"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("tailguard-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel installed; the dependencies come from this interpreter's
    site-packages through a plain path entry (its .pth files, the editable install's finder
    among them, are not read there)."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    yield home


def installed_run(home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(home / "bin" / "tailguard"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_wheel_installs_one_tailguard_namespace_and_no_benchmark_driver(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tailguard"}
    assert "tailguard/server/config.toml" in names and "tailguard/server/py.typed" in names
    assert not [name for name in names if name.startswith("tailguard/bench")]
    # Every module of the three source folders is in the wheel, under its installed name.
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert f"{package.replace('.', '/')}/{path.relative_to(folder).as_posix()}" in names


def test_pyproject_lists_every_package_under_the_source_folders() -> None:
    """setuptools installs only the packages listed; a new sub-package must be added there."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            found.add(".".join([package, *relative.parts]))
    assert listed == found


def test_nothing_imports_the_simulator_as_bench_sim() -> None:
    """``bench.sim`` and ``tailguard.sim`` would be two copies of one module, with two sets of classes."""
    by_old_name = re.compile(r"^\s*(from|import) bench(\.sim\b(?!_)| import sim\b)", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("router", "server", "bench", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if by_old_name.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_check_config_runs_from_any_folder_on_the_shipped_config(installed: Path, tmp_path: Path) -> None:
    result = installed_run(installed, tmp_path, "check-config")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("config file: ") and first.endswith("tailguard/server/config.toml")
    assert str(installed) in first  # the installed copy, not the checkout's
    assert "pool interactive" in result.stdout


async def test_serve_simulate_answers_from_a_temporary_folder(installed: Path, tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    config_on_free_ports(tmp_path, ports)  # ./config.toml wins over the shipped one
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.Popen(
        [str(installed / "bin" / "tailguard"), "serve", "--simulate", "--log-level", "WARNING"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", timeout=30) as client:
            await until_healthy(client, process, seconds=40)
            body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[0][len("data: ") :])["object"] == "chat.completion.chunk"
        process.send_signal(signal.SIGTERM)
        assert await exited(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()
